"""Progress lines on stderr for long CLI work: done/total, rate and ETA, at least every `interval` seconds.

    with Progress(total=8, unit="images", label="mmenc encode") as progress:
        for ...:
            progress.advance(1)

A background thread prints the current state every `interval` seconds (so a slow tower call still
shows signs of life), and the last line is printed when the block ends. stdout stays for results.
"""
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(self, total: int, *, unit: str, label: str, interval: float = 2.0, enabled: bool = True,
                 stream: TextIO | None = None):
        if interval <= 0:
            raise ValueError(f"interval={interval} must be > 0 seconds")
        self.total, self.unit, self.label, self.interval = total, unit, label, interval
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.done = 0
        self.count: Callable[[], int] | None = None  # where `done` is read from, if not advance()'s count
        self.note: Callable[[], str] | None = None  # appended to each line, e.g. "3 shard(s) written"
        self._start = time.perf_counter()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def advance(self, n: int = 1) -> None:
        with self._lock:
            self.done += n

    def line(self) -> str:
        """e.g. 'mmenc encode: 3/8 images (38%), 0.42 images/s, 7 s elapsed, ETA 12 s'."""
        with self._lock:
            done = self.done if self.count is None else self.count()
        elapsed = time.perf_counter() - self._start
        share = f" ({100 * done // self.total}%)" if self.total else ""
        text = f"{self.label}: {done}/{self.total} {self.unit}{share}, {_duration(elapsed)} elapsed"
        if done:
            rate = done / max(elapsed, 1e-9)
            text += f", {rate:.2f} {self.unit}/s"
            if done < self.total:
                text += f", ETA {_duration((self.total - done) / rate)}"
        elif self.total:
            text += ", ETA after the first one"
        if self.note is not None:
            text += f"; {self.note()}"
        return text

    def print(self) -> None:
        if self.enabled:
            print(self.line(), file=self.stream, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(self.interval):
            self.print()

    def __enter__(self) -> "Progress":
        self._start = time.perf_counter()
        if self.enabled:
            self._thread = threading.Thread(target=self._beat, name="mmenc-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.print()


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"
