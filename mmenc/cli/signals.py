"""SIGTERM and SIGHUP for the batch commands: what `kill`, `timeout`, systemd, Kubernetes and Slurm send
(SIGTERM), or a closed terminal (SIGHUP), stops `mmenc encode` as Ctrl-C does: the work done so far
is written, the command says so and exits 128 + the signal's number (130 Ctrl-C, 143 SIGTERM, 129 SIGHUP).

    with stop_on_signals():
        try:
            work()
        except KeyboardInterrupt as e:   # Ctrl-C, or Stopped (a subclass) for SIGTERM / SIGHUP
            save(); return exit_code(e)
"""
import contextlib
import signal
import threading
from collections.abc import Iterator

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM / SIGHUP (a KeyboardInterrupt, so every Ctrl-C path keeps the work)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def exit_code(error: BaseException) -> int:
    """128 + the signal's number: 130 for Ctrl-C (SIGINT), 143 for SIGTERM, 129 for SIGHUP."""
    return 128 + int(getattr(error, "signum", signal.SIGINT))


def describe(error: BaseException) -> str:
    """'interrupted' (Ctrl-C) or 'stopped by SIGTERM' / 'stopped by SIGHUP'."""
    signum = getattr(error, "signum", None)
    return "interrupted" if signum is None else f"stopped by {signal.Signals(signum).name}"


@contextlib.contextmanager
def stop_on_signals(signals: tuple[int, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block (main thread only), the first SIGTERM / SIGHUP raises Stopped; later ones are
    ignored, so the partial result being written is not cut short too. The handlers are restored after.
    Outside the main thread (where Python runs signal handlers) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []

    def handler(signum, frame) -> None:
        if not seen:
            seen.append(signum)
            raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
