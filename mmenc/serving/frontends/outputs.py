"""SharedOutputs: the engine's embeddings in pooled shared-memory segments, so an answer (and a
cached entry sent again) reaches a front end without a copy. The batcher copies each image's
output into `alloc(shape, dtype)` (instead of a clone); a segment goes back to the pool once the
engine's tensor is gone (answered and out of the cache) and every front end it was sent to has
released it."""
import collections
import threading
import weakref
from collections.abc import Callable

import torch

from mmenc.shm import Segment, SegmentPool


class SharedOutputs:
    def __init__(self, pool: SegmentPool, on_destroy: Callable[[Segment], None]):
        """on_destroy(segment): the pool dropped it; its peers must forget it."""
        self.pool, self._on_destroy = pool, on_destroy
        self._by_ptr: dict[int, Segment] = {}
        self._by_id: dict[int, Segment] = {}
        self._lock = threading.Lock()

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        segment = self.pool.take(numel * torch.empty((), dtype=dtype).element_size())
        tensor = segment.tensor(shape, dtype)
        with self._lock:
            segment.refs = 1  # the engine's tensor
            self._by_ptr[segment.storage.data_ptr()] = self._by_id[segment.id] = segment
        weakref.finalize(tensor, self.unref, segment.id)
        return tensor

    def segment_of(self, tensor: torch.Tensor) -> Segment | None:
        """The segment holding `tensor` (one of ours), else None."""
        with self._lock:
            return self._by_ptr.get(tensor.untyped_storage().data_ptr())

    def ref(self, segment: Segment) -> None:
        with self._lock:
            segment.refs += 1

    def unref(self, segment_id: int, count: int = 1) -> None:
        with self._lock:
            segment = self._by_id.get(segment_id)
            if segment is None:
                return
            segment.refs -= count
            if segment.refs > 0:
                return
            del self._by_id[segment_id], self._by_ptr[segment.storage.data_ptr()]
        if not self.pool.give_back(segment):
            self._on_destroy(segment)


class Holdings:
    """Segments sent to one front end and not yet released by it (dropped all at once if it dies)."""

    def __init__(self):
        self._counts: collections.Counter = collections.Counter()
        self._lock = threading.Lock()

    def add(self, segment_id: int) -> None:
        with self._lock:
            self._counts[segment_id] += 1

    def remove(self, segment_id: int) -> bool:
        with self._lock:
            if self._counts[segment_id] <= 0:
                return False
            self._counts[segment_id] -= 1
            if not self._counts[segment_id]:
                del self._counts[segment_id]
            return True

    def drain(self) -> dict[int, int]:
        with self._lock:
            counts, self._counts = dict(self._counts), collections.Counter()
        return counts
