"""The batcher: the only caller of the tower. Images from every request wait in one queue; tower
calls are formed in arrival order and handed back through concurrent.futures.Futures.

Two threads, so the device never waits for Python:
  "mmenc-tower" (launcher): waits for a free slot (at most `max_in_flight` calls launched and not
    yet handed back), takes the queued images into one call of up to `max_batch_patches` patches
    (or fewer once the first has waited `max_wait_ms`), gathers their inputs into the slot's pinned
    buffer, launches the tower, queues the copy of its output into the slot's pinned output buffer
    and records an event; then it forms the next call at once.
  "mmenc-tower-out" (completer): waits for each call's event in launch order, cuts the output into
    one tensor per image (each owning its storage), checks it is finite, sets the futures, and
    frees the slot.
On the CPU a launch runs the tower to the end; the completer still overlaps the next call.

Bucketing (bucket=True, for CUDA graphs, whose key is the call's whole packing): the images of
each size in a call are cut to a power of two (1, 2, 4, ...) and sorted by size, so a steady load
reuses a few packings; the images cut wait first in line for the next call.

A job whose future was cancelled (its client left) before its tower call started is dropped."""
import collections
import concurrent.futures
import dataclasses
import math
import queue
import threading
import time
from collections.abc import Callable

import torch

from mmenc.engine.checks import all_finite
from mmenc.logger import init_logger
from mmenc.serving.formats import EncodedImage
from mmenc.serving.metrics import ServeMetrics
from mmenc.vllm_inputs import image_embeds

logger = init_logger(__name__)

_MAX_PACKINGS = 4096  # distinct packings counted (a server seeing endless new sizes stops counting there)


@dataclasses.dataclass
class Job:
    """pixel_values of one preprocessed image: float [patches, C*tp*p*p], or the uint8 patches
    [patches, *row_shape] that the Batcher's `prepare` normalizes on the device; grid_thw [1, 3]."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    enqueued: float = dataclasses.field(default_factory=time.perf_counter)

    @property
    def patches(self) -> int:
        return int(self.grid_thw[:, :3].prod())

    @property
    def size_key(self) -> tuple[int, ...]:
        return tuple(self.grid_thw[0].tolist())


def bucket(batch: list[Job]) -> tuple[list[Job], list[Job]]:
    """(the call, the rest): per image size, the first 2**k of its images (largest k that fits),
    sizes in ascending order; the rest keeps its arrival order."""
    groups: dict[tuple[int, ...], list[Job]] = collections.defaultdict(list)
    for job in batch:
        groups[job.size_key].append(job)
    run: list[Job] = []
    for key in sorted(groups):
        jobs = groups[key]
        run += jobs[:1 << (len(jobs).bit_length() - 1)]
    chosen = {id(job) for job in run}
    return run, [job for job in batch if id(job) not in chosen]


@dataclasses.dataclass
class _Slot:
    """One call in flight: its pinned input and output buffers (reused) and what the completer needs."""

    staging: torch.Tensor | None = None
    out_buf: torch.Tensor | None = None
    event: object = None
    batch: list = dataclasses.field(default_factory=list)
    output: torch.Tensor | None = None  # [tokens, width] on the CPU (a view of out_buf on CUDA)
    finite: torch.Tensor | None = None
    grid: torch.Tensor | None = None
    hidden: int = 0
    start: float = 0.0


class Batcher:
    """encode_pixels(pixel_values, grid_thw, return_extras=True) -> TowerOutput and
    output_tokens(grid_thw) -> list[int] are the Encoder's (or its `launch`, without a host sync);
    they are only ever called from the launcher thread. prepare(pixel_values) -> tower input, for
    uint8 jobs (e.g. normalize on the device). check_finite(cpu embeddings, tokens): called by the
    completer only when the device-side check found a non-finite value (may raise). graph_stats() ->
    {"eager"|"captures"|"replays": count}: the tower's CUDA graph counters, copied into the metrics.
    alloc(shape, dtype) (attribute, default None: a clone): the tensor each image's output is copied
    into (front ends: shared memory, so it crosses to them without another copy)."""

    def __init__(self, encode_pixels: Callable, output_tokens: Callable, max_batch_patches: int,
                 max_wait_ms: float, metrics: ServeMetrics, pin_memory: bool = False, *,
                 device: torch.device | str = "cpu", prepare: Callable | None = None,
                 check_finite: Callable | None = None, bucket: bool = False, max_in_flight: int = 2,
                 graph_stats: Callable[[], dict] | None = None):
        """pin_memory (CUDA towers): gather each call's input into a reused pinned buffer per slot (an
        asynchronous copy to the device) and copy its output back into another (ditto)."""
        if max_in_flight < 1:
            raise ValueError(f"max_in_flight={max_in_flight} must be >= 1 (2 keeps the device busy)")
        self._encode_pixels, self._output_tokens = encode_pixels, output_tokens
        self.pin_memory, self.device = pin_memory, torch.device(device)
        self.prepare, self._check_finite, self.bucket = prepare, check_finite, bucket
        self.max_batch_patches, self.max_wait_s = max_batch_patches, max_wait_ms / 1000.0
        self.metrics, self.graph_stats = metrics, graph_stats
        self.alloc: Callable[[tuple, torch.dtype], torch.Tensor] | None = None  # where each image's output goes
        self.packings: collections.Counter = collections.Counter()  # tower calls per packing (grid list)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._carry: collections.deque[Job] = collections.deque()
        self._free: queue.Queue[_Slot] = queue.Queue()
        for _ in range(max_in_flight):
            self._free.put(_Slot())
        self._done: queue.Queue[_Slot | None] = queue.Queue()
        self._completer = threading.Thread(target=self._complete_loop, name="mmenc-tower-out", daemon=True)
        self._completer.start()
        self._thread = threading.Thread(target=self._loop, name="mmenc-tower", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> concurrent.futures.Future:
        self.metrics.queue_depth.inc()
        self._queue.put(job)
        return job.future

    def close(self, timeout: float | None = None) -> None:
        """Finish every job queued so far, then stop both threads."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._completer.join(timeout)

    def alive(self) -> bool:
        """Whether a thread of the batcher still runs (e.g. a tower call that outlived close's timeout)."""
        return self._thread.is_alive() or self._completer.is_alive()

    # -- the launcher thread --------------------------------------------------------------------
    def _take(self, block_s: float | None) -> Job | None | bool:
        """The next job not cancelled yet; None for the stop marker; False when nothing came within block_s."""
        while True:
            if self._carry:
                job = self._carry.popleft()
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
        try:
            while True:
                slot = self._free.get()  # a free slot first: the call then holds all that queued meanwhile
                first = self._take(None)
                if first is None:
                    self._free.put(slot)
                    break
                batch, patches = [first], first.patches
                deadline = first.enqueued + self.max_wait_s
                while patches < self.max_batch_patches:
                    job = self._take(deadline - time.perf_counter())
                    if job is False:
                        break
                    if job is None:
                        stopping = True  # run what we hold (and carry), then stop
                        break
                    if patches + job.patches > self.max_batch_patches:
                        self._carry.appendleft(job)
                        break
                    batch.append(job)
                    patches += job.patches
                self._dispatch(batch, slot)
                if stopping:
                    self._drain_carry()
                    break
        finally:
            self._done.put(None)

    def _drain_carry(self) -> None:
        """After the stop marker: the carried jobs, in calls of at most max_batch_patches."""
        while self._carry:
            slot = self._free.get()
            batch, patches = [], 0
            while self._carry and (not batch or patches + self._carry[0].patches <= self.max_batch_patches):
                job = self._carry.popleft()
                batch.append(job)
                patches += job.patches
            self._dispatch(batch, slot)

    def _dispatch(self, batch: list[Job], slot: _Slot) -> None:
        """With buckets on, keep the batch's bucketed part and carry the rest to the next call; drop
        the jobs cancelled while the batch filled; the others can no longer be cancelled."""
        if self.bucket:
            batch, rest = bucket(batch)
            self._carry.extendleft(reversed(rest))
        live = [job for job in batch if job.future.set_running_or_notify_cancel()]
        if not live:
            self._free.put(slot)
            return
        slot.batch, slot.start = live, time.perf_counter()
        for job in live:
            self.metrics.queue_seconds.observe(slot.start - job.enqueued)
        try:
            self._launch(slot)
        except Exception as e:  # noqa: BLE001 - the failure belongs to these images' requests, not the server
            logger.exception("tower call over %d images failed", len(live))
            self._fail(slot, e)
            return
        self._done.put(slot)

    def _launch(self, slot: _Slot) -> None:
        batch = slot.batch
        grid = slot.grid = torch.cat([j.grid_thw for j in batch])
        packing = tuple(tuple(g) for g in grid.tolist())
        if packing in self.packings or len(self.packings) < _MAX_PACKINGS:
            self.packings[packing] += 1
            self.metrics.packings.set(len(self.packings))
        pixel_values = self._gather(slot, [j.pixel_values for j in batch])
        if self.prepare is not None and not pixel_values.is_floating_point():
            pixel_values = self.prepare(pixel_values.to(self.device, non_blocking=True))
        if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi) -> one row per patch
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        out = self._encode_pixels(pixel_values, grid, return_extras=True)
        slot.hidden = out.embeddings.shape[1]
        full = image_embeds(out)
        slot.finite = all_finite(out.embeddings) if self._check_finite is not None else None
        if full.device.type == "cpu":
            slot.output = full
            return
        if self.pin_memory:
            n = full.numel()
            if slot.out_buf is None or slot.out_buf.numel() < n or slot.out_buf.dtype != full.dtype:
                slot.out_buf = torch.empty(n, dtype=full.dtype, pin_memory=True)
            slot.output = slot.out_buf[:n].view(full.shape)
            slot.output.copy_(full, non_blocking=True)
            slot.finite = None if slot.finite is None else slot.finite.to("cpu", non_blocking=True)
        else:
            slot.output = full.to("cpu", non_blocking=False)
            slot.finite = None if slot.finite is None else slot.finite.cpu()
        if full.device.type == "cuda":
            slot.event = torch.cuda.Event()
            slot.event.record()

    def _gather(self, slot: _Slot, parts: list[torch.Tensor]) -> torch.Tensor:
        """[patches_i, ...] each -> [sum patches_i, ...]. With pin_memory, a view of the slot's staging
        buffer: the slot is reused only after its call's event (which follows the input copy)."""
        if not self.pin_memory:
            return torch.cat(parts) if len(parts) > 1 else parts[0]
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        numel = math.prod(shape)
        if slot.staging is None or slot.staging.numel() < numel or slot.staging.dtype != parts[0].dtype:
            slot.staging = torch.empty(numel, dtype=parts[0].dtype, pin_memory=True)
        out = slot.staging[:numel].view(shape)
        torch.cat(parts, out=out)
        return out

    # -- the completer thread -------------------------------------------------------------------
    def _complete_loop(self) -> None:
        while (slot := self._done.get()) is not None:
            try:
                pieces = self._finish(slot)
            except Exception as e:  # noqa: BLE001 - as in _dispatch: these images' failure
                logger.exception("tower call over %d images failed", len(slot.batch))
                self._fail(slot, e)
                continue
            batch, grid, hidden = slot.batch, slot.grid, slot.hidden
            self.metrics.tower_seconds.observe(time.perf_counter() - slot.start)
            self.metrics.batch_images.observe(len(batch))
            self.metrics.batch_patches.observe(sum(job.patches for job in batch))
            if self.graph_stats is not None:
                for kind, count in self.graph_stats().items():
                    self.metrics.cuda_graph_calls.labels(kind=kind).set(count)
            self._release(slot)
            for job, piece, g in zip(batch, pieces, grid.tolist()):
                job.future.set_result(EncodedImage(piece, hidden, tuple(g)))

    def _finish(self, slot: _Slot) -> list[torch.Tensor]:
        if slot.event is not None:
            slot.event.synchronize()
        tokens = self._output_tokens(slot.grid)
        if slot.finite is not None and not bool(slot.finite):
            self._check_finite(slot.output[:, :slot.hidden], tokens)
        if self.alloc is None:
            return [piece.clone() for piece in slot.output.split(tokens)]
        return [self.alloc(tuple(piece.shape), piece.dtype).copy_(piece) for piece in slot.output.split(tokens)]

    def _fail(self, slot: _Slot, error: Exception) -> None:
        batch = slot.batch
        if self.device.type == "cuda" and torch.cuda.is_available():
            try:  # copies of the failed call may still be queued: its buffers are reused only after them
                torch.cuda.synchronize(self.device)
            except RuntimeError as e:
                logger.error("synchronizing %s after a failed tower call failed too (%s)", self.device, e)
        self._release(slot)
        for job in batch:
            job.future.set_exception(error)

    def _release(self, slot: _Slot) -> None:
        slot.batch, slot.output, slot.finite, slot.grid, slot.event = [], None, None, None, None
        self._free.put(slot)
