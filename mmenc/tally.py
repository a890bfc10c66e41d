"""Tally: named running totals (seconds, counts) that the pipeline adds to and benchmarks read.

    tally = Tally()
    with tally.time("stage_s"):          # adds the block's wall seconds to "stage_s"
        ...
    tally.add(chunks=1, images=8)
    before = tally.snapshot(); ...; spent = tally.since(before)   # {"stage_s": 0.012, "chunks": 1, ...}

Totals only grow; several threads may add at once (a lock). Nothing reads them on the hot path.
"""
import contextlib
import threading
import time


class Tally:
    def __init__(self):
        self._lock = threading.Lock()
        self._totals: dict[str, float] = {}

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._totals[name] = self._totals.get(name, 0) + amount

    @contextlib.contextmanager
    def time(self, name: str):
        """Adds the wall seconds spent inside the block to `name` (also when it raises)."""
        begin = time.perf_counter()
        try:
            yield
        finally:
            self.add(**{name: time.perf_counter() - begin})

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._totals)

    def since(self, before: dict[str, float]) -> dict[str, float]:
        """What was added since `before` (a snapshot), every name seen so far included."""
        now = self.snapshot()
        return {name: now[name] - before.get(name, 0) for name in sorted(now)}
