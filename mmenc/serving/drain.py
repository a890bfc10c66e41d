"""Drain: how one server stops (SIGTERM / SIGINT, a front end told to stop, a Ray replica told to drain).

    serving --begin(timeout)--> draining --timeout passes--> cut
                                   |  requests in flight go on; new ones: 503 shutting_down
                                   '--> idle (nothing in flight): the server may exit at once

At the cut, every request still in flight is answered 503 `shutting_down` (retryable, Retry-After),
its images not yet in a tower call are dropped, and the count is kept (`cut`) for the log. The HTTP
host (uvicorn: DrainingServer in uvicorn_run; a Ray replica: mmenc.ray.serve) calls `begin`; the
route (app.py) calls `enter` / `leave` around each request and `on_cut` to be woken. Thread safe:
begin and the cut run in any thread; the callbacks must hop to their own event loop."""
import threading
from collections.abc import Callable

from mmenc.logger import init_logger

logger = init_logger(__name__)


class Drain:
    def __init__(self):
        self.state = "serving"  # serving | draining | cut
        self.active = 0  # requests in flight (entered, not left)
        self.answered_while_draining = 0  # requests that finished after begin()
        self.cut = 0  # requests answered 503 shutting_down at the cut
        self.refused = 0  # requests that arrived after begin(): 503 shutting_down at once
        self.timeout_s: float | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0
        self._timer: threading.Timer | None = None

    @property
    def draining(self) -> bool:
        return self.state != "serving"

    def begin(self, timeout_s: float) -> None:
        """Stop admitting requests; cut those still in flight after `timeout_s` seconds. Idempotent."""
        with self._lock:
            if self.state != "serving":
                return
            self.state, self.timeout_s = "draining", timeout_s
            if self.active == 0:
                self._idle.set()
            active = self.active
        logger.info("mmenc serve: draining: %d request(s) in flight get up to %.0f s (--shutdown-timeout); new "
                    "ones are answered 503 shutting_down", active, timeout_s)
        self._timer = threading.Timer(timeout_s, self._cut)
        self._timer.daemon = True
        self._timer.start()

    def enter(self) -> bool:
        """A request arrives: True when admitted (then `leave` it), False while draining (refuse it)."""
        with self._lock:
            if self.state != "serving":
                self.refused += 1
                return False
            self.active += 1
            self._idle.clear()
            return True

    def leave(self, cut: bool = False) -> None:
        with self._lock:
            self.active -= 1
            if cut:
                self.cut += 1
            elif self.state != "serving":
                self.answered_while_draining += 1
            if self.active == 0 and self.state != "serving":
                self._idle.set()

    def on_cut(self, callback: Callable[[], None]) -> Callable[[], None]:
        """callback() at the cut (at once if it is past); returns the function that unregisters it."""
        with self._lock:
            if self.state != "cut":
                token, self._next = self._next, self._next + 1
                self._callbacks[token] = callback
                return lambda: self._callbacks.pop(token, None)
        callback()
        return lambda: None

    def wait_idle(self, timeout: float | None = None) -> bool:
        """After begin: True once nothing is in flight (within `timeout` seconds)."""
        return self._idle.wait(timeout)

    def summary(self) -> str:
        return (f"{self.answered_while_draining} request(s) answered while draining, {self.cut} cut at the "
                f"{self.timeout_s:g} s --shutdown-timeout (503 shutting_down), {self.refused} refused after the "
                f"signal (503 shutting_down)")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _cut(self) -> None:
        with self._lock:
            if self.state != "draining":
                return
            self.state = "cut"
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        if callbacks:
            logger.warning("mmenc serve: --shutdown-timeout %.0f s passed with %d request(s) in flight; answering "
                           "them 503 shutting_down", self.timeout_s, len(callbacks))
        for callback in callbacks:
            callback()
