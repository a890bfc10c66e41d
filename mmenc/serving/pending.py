"""Pending: one request's images between the event loop and the answer, settled from pool threads
and the batcher's completer without waking the event loop until the answer is ready."""
import concurrent.futures
import threading
from collections.abc import Callable


class Pending:
    """`answer` (a concurrent Future the event loop awaits) gets finish(items) once all `n` items
    are settled (items in input order, by index); finish runs in the pool given to the last settle.
    Any exception raised under `guard` fails the answer (the route then answers 500)."""

    def __init__(self, n: int, finish: Callable[[list], object]):
        self.answer: concurrent.futures.Future = concurrent.futures.Future()
        self.items: list = [None] * n
        self._left, self._finish = n, finish
        self._jobs: list[concurrent.futures.Future] = []
        self._lock = threading.Lock()

    def guard(self, fn: Callable, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the request (a 500), not lost in a pool thread
            self._fail(e)

    def settle(self, index: int, item, pool: concurrent.futures.Executor) -> None:
        with self._lock:
            self.items[index] = item
            self._left -= 1
            last = self._left == 0
        if last and not self.answer.done():
            pool.submit(self.guard, self._answer)

    def track(self, job: concurrent.futures.Future) -> concurrent.futures.Future:
        """A batcher job of this request: cancelled with it (at once if it already was)."""
        with self._lock:
            self._jobs.append(job)
        if self.answer.cancelled():
            job.cancel()
        return job

    def cancel(self) -> int:
        """Cancel the jobs not yet in a tower call; returns how many images were left unanswered."""
        self.answer.cancel()
        with self._lock:
            jobs, left = list(self._jobs), self._left
        for job in jobs:
            job.cancel()
        return left

    def _answer(self) -> None:
        body = self._finish(self.items)
        try:
            self.answer.set_result(body)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile: the client left
            pass
        self._let_go()

    def _fail(self, error: BaseException) -> None:
        try:
            self.answer.set_exception(error)
        except concurrent.futures.InvalidStateError:
            pass
        self._let_go()

    def _let_go(self) -> None:
        """Drop the jobs and items (each job's callback refers back to this object: without this the
        answers' tensors, which may be shared memory the engine waits to reuse, live until a gc pass)."""
        with self._lock:
            self._jobs = []
        self.items = [None] * len(self.items)
