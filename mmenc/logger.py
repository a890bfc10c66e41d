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


def log_once(logger: logging.Logger, message: str, _seen: set = set(), *, level: int = logging.INFO,
             key: str | None = None) -> None:
    """Log `message` (at INFO unless `level`) the first time it, or its `key` if given, is seen in this process."""
    if (key or message) not in _seen:
        _seen.add(key or message)
        logger.log(level, message)
