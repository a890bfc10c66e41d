"""The batcher: the only caller of the tower. Images from every request wait in one queue; a
dedicated thread takes them in arrival order into one tower call of up to `max_batch_patches`
patches, or fewer once the first of them has waited `max_wait_ms`, and hands each image its
EncodedImage (or the tower's exception) through a concurrent.futures.Future.

A job whose future was cancelled (its client left) before its tower call started is dropped."""
import concurrent.futures
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from mmenc.logger import init_logger
from mmenc.serving.formats import EncodedImage
from mmenc.serving.metrics import ServeMetrics

logger = init_logger(__name__)


@dataclasses.dataclass
class Job:
    """pixel_values [patches, C*tp*p*p] and grid_thw [1, 3] of one preprocessed image."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def patches(self) -> int:
        return int(self.grid_thw.prod())


def combine(out, tokens: list[int]) -> list[torch.Tensor]:
    """A tower call's TowerOutput -> one CPU tensor per image, [tokens_i, hidden * (1 + levels)],
    each owning its storage (so torch.save of one writes only that image)."""
    parts = [out.embeddings] + list(out.extras.get("deepstack") or [])
    full = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    full = full.cpu()
    return [piece.clone() for piece in full.split(tokens)]


class Batcher:
    """encode_pixels(pixel_values, grid_thw) -> TowerOutput and output_tokens(grid_thw) -> list[int]
    are the Encoder's; they are only ever called from this object's thread."""

    def __init__(self, encode_pixels: Callable, output_tokens: Callable, max_batch_patches: int,
                 max_wait_ms: float, metrics: ServeMetrics, pin_memory: bool = False):
        """pin_memory (CUDA towers): gather each batch's pixels into one reused pinned buffer, so the
        copy to the device is asynchronous and fast."""
        self._encode_pixels, self._output_tokens = encode_pixels, output_tokens
        self.pin_memory = pin_memory
        self._staging: torch.Tensor | None = None
        self.max_batch_patches, self.max_wait_s = max_batch_patches, max_wait_ms / 1000.0
        self.metrics = metrics
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._carry: Job | None = None
        self._thread = threading.Thread(target=self._loop, name="mmenc-tower", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        self.metrics.queue_depth.inc()
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Finish every job queued so far, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    # -- the tower thread -----------------------------------------------------------------------
    def _take(self, block_s: float | None) -> Job | None | bool:
        """The next job not cancelled yet; None for the stop marker; False when nothing came within block_s."""
        while True:
            if self._carry is not None:
                job, self._carry = self._carry, None
            else:
                try:
                    job = self._queue.get(timeout=block_s) if block_s is None or block_s > 0 else self._queue.get_nowait()
                except queue.Empty:
                    return False
                if job is None:
                    return None
                self.metrics.queue_depth.dec()
            if not job.future.cancelled():
                return job

    def _loop(self) -> None:
        stopping = False
        while not stopping:
            first = self._take(None)
            if first is None:
                break
            batch, patches = [first], first.patches
            deadline = first.enqueued + self.max_wait_s
            while patches < self.max_batch_patches:
                job = self._take(deadline - time.perf_counter())
                if job is False:
                    break
                if job is None:
                    stopping = True  # run what we hold, then stop
                    break
                if patches + job.patches > self.max_batch_patches:
                    self._carry = job
                    break
                batch.append(job)
                patches += job.patches
            self._dispatch(batch)
        if self._carry is not None:
            self._dispatch([self._carry])

    def _dispatch(self, batch: list[Job]) -> None:
        """Drop the jobs cancelled while the batch filled; the others can no longer be cancelled."""
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if live:
            self._run(live, sum(job.patches for job in live))

    def _gather(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """[patches_i, F] each -> [sum patches_i, F]. With pin_memory, a view of the staging buffer:
        reusing it is safe because the previous call's output was copied back to the CPU (which waits
        for that call, its input copy included) before this batch was gathered."""
        if not self.pin_memory:
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        numel = math.prod(shape)
        if self._staging is None or self._staging.numel() < numel or self._staging.dtype != parts[0].dtype:
            self._staging = torch.empty(numel, dtype=parts[0].dtype, pin_memory=True)
        out = self._staging[:numel].view(shape)
        torch.cat(parts, out=out)
        return out

    def _run(self, batch: list[Job], patches: int) -> None:
        start = time.perf_counter()
        for job in batch:
            self.metrics.queue_seconds.observe(start - job.enqueued)
        try:
            grid = torch.cat([j.grid_thw for j in batch])
            pixel_values = self._gather([j.pixel_values for j in batch])
            out = self._encode_pixels(pixel_values, grid, return_extras=True)
            hidden = out.embeddings.shape[1]
            pieces = combine(out, self._output_tokens(grid))
        except Exception as e:  # noqa: BLE001 - the failure belongs to these images' requests, not the server
            logger.exception("tower call over %d images (%d patches) failed", len(batch), patches)
            for job in batch:
                job.future.set_exception(e)
            return
        self.metrics.tower_seconds.observe(time.perf_counter() - start)
        self.metrics.batch_images.observe(len(batch))
        self.metrics.batch_patches.observe(patches)
        for job, piece, g in zip(batch, pieces, grid.tolist()):
            job.future.set_result(EncodedImage(piece, hidden, tuple(g)))
