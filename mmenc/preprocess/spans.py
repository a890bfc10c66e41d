"""A record of where a Preprocessor's time goes, step by step, for profiling tools
(Preprocessor.step_spans; benchmarks/e2e_profile.py, preprocess_cpu.py read it)."""
import contextlib
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch


class StepSpan(NamedTuple):
    """One step seen while the record was open: "prepare" (an image) or "stage" (a chunk), the thread it ran
    in, perf_counter start and end, and that thread's CPU seconds over it."""

    step: str
    thread: str
    start: float
    end: float
    cpu_s: float


class StepSpans:
    """span(step) records a StepSpan while a record is open (open()); closed, it is a no-op context."""

    def __init__(self):
        self._spans: list[StepSpan] | None = None
        self._sync: torch.device | None = None

    @contextlib.contextmanager
    def open(self, sync: torch.device | None = None) -> Iterator[list[StepSpan]]:
        """The list the spans go to while open; sync: a CUDA device synchronised before a "stage" span ends."""
        spans: list[StepSpan] = []
        self._spans, self._sync = spans, sync
        try:
            yield spans
        finally:
            self._spans = None

    def span(self, step: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._spans is None else self._record(self._spans, step)

    @contextlib.contextmanager
    def _record(self, spans: list[StepSpan], step: str):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            if step == "stage" and self._sync is not None:
                torch.cuda.synchronize(self._sync)
            spans.append(StepSpan(step, threading.current_thread().name, start, time.perf_counter(),
                                  time.thread_time() - cpu))
