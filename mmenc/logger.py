"""One logger for the package: ``mmenc`` and its children, INFO by default on stderr."""
import logging

_ROOT = "mmenc"


def init_logger(name: str) -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s mmenc %(name)s: %(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        root.propagate = False
    return logging.getLogger(name)


def log_once(logger: logging.Logger, message: str, _seen: set = set()) -> None:
    """Log `message` at INFO the first time it is seen in this process."""
    if message not in _seen:
        _seen.add(message)
        logger.info(message)
