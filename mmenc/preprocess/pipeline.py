"""Preprocessing that keeps up: images decoded and resized in parallel, per image, beside the tower.

    pre = Preprocessor(processor, device="cuda")          # workers: one thread per usable core
    out = pre.run(images, errors="skip")                   # (pixel_values, grid_thw, failures)
    for chunk in pre.iter_chunks(images, max_batch_patches=1 << 16):   # streaming, bounded memory
        tower(chunk.pixel_values, chunk.grid_thw)          # chunk.indices: their input positions

Per image, in a worker (mmenc.preprocess.prepare.ImageWork.prepare): load/decode (torchvision's
libjpeg-turbo for plain JPEGs when it imports, else PIL's `load_image`), `processor.plan` (size
rules; a bad size fails that image only), the bicubic resize on the CPU if it runs there. Workers
(`worker_kind`): "thread", a thread pool (the decoders and torch's resize release the GIL, the rest
of the work holds it); "process", worker processes for paths and bytes (mmenc.preprocess.procs:
the calling thread, which launches the tower, then shares the GIL with no decoder; results cross
in shared memory, PIL images and arrays stay in threads); "auto": processes on a CUDA device with at
least PROCESS_MIN_WORKERS workers (measured faster there), else threads (mmenc.preprocess.placement).
Per chunk, in the calling thread: for a CUDA device each uint8 image is copied by numpy into
pinned memory in its decoded [H, W, C] layout (no transpose) and crosses by one non-blocking copy
(a quarter of the bytes float32 would take; the workers make no CUDA call, since one from another
thread during a CUDA graph capture breaks the capture), the resize runs there, and `processor.finish`
rescales, normalizes and patchifies. That device work is queued on a side stream of the Preprocessor's
(`stage_beside`), so it runs while the tower's previous call does; the current stream waits for it
before the next tower call (on an H200 it had sat between tower calls: 193 ms of a 600-image stream's
4.3 s, run 15a). No torch op runs on the host in the calling thread (torch's intra-op threads, one per
core, beside busy workers made a 26 MB torch.cat take 86 ms). Output order is input order.

Where the work runs (`worker_kind`, `resize`, `decode`; "auto" picks) is chosen once, at construction, by
mmenc.preprocess.placement (its docstring says what each choice does and when "auto" takes it).

With resize="cpu" the result is bitwise the processor's own `__call__` on the CPU; with
resize="device" likewise for the "torchvision" backend (tests/test_preprocess_pipeline.py).
"""
import collections
import contextlib
import math
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, NamedTuple

import torch

from mmenc.preprocess import gpu_decode
from mmenc.preprocess.images import HIGH_BIT_DEPTH, ImageLoadError, LoadFailure, load_image
from mmenc.preprocess.placement import choose_decode, choose_resize, choose_worker_kind, default_workers
from mmenc.preprocess.plan import ImagePreprocessError, finish_patches, input_name
from mmenc.preprocess.prepare import ImageWork, Ready
from mmenc.preprocess.procs import ProcessWorkers, runs_in_process
from mmenc.preprocess.schedule import ChunkSchedule
from mmenc.preprocess.spans import StepSpan, StepSpans
from mmenc.preprocess.staging import to_device_each
from mmenc.preprocess.video import VideoPiece
from mmenc.preprocess.video_units import VideoUnits
from mmenc.tally import Tally


class Preprocessed(NamedTuple):
    """`Preprocessor.run`'s result. pixel_values: float32 on the device ([P, D], Kimi [P, C, p, p]);
    grid_thw: int64 [n, 3] on the CPU; failures: LoadFailure per input that failed (errors="skip")."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    failures: list[LoadFailure]


class Chunk(NamedTuple):
    """One ready batch of `iter_chunks`: as Preprocessed, plus indices (the input positions of its n
    images, ascending). failures: inputs skipped since the previous chunk. n may be 0.
    videos: with video inputs, per entry of indices its VideoPiece (a run of whole temporal units of
    that video: one or, for Kimi, several grid rows; a long video's pieces repeat its index over
    consecutive entries and chunks), None for an image; () when the chunk holds no video."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    indices: list[int]
    failures: list[LoadFailure]
    videos: tuple = ()


class Preprocessor:
    """Runs a processor (`plan`, `resize_one`, `patchify`, `normalize`, ...: QwenVLProcessor, KimiProcessor)
    over many images in parallel. See the module docstring; close() (or `with`) stops the worker
    threads and processes."""

    def __init__(self, processor: Any, *, device: str | torch.device | None = None, workers: int | None = None,
                 resize: Literal["auto", "cpu", "device", "split"] = "auto",
                 decode: Literal["auto", "cpu", "gpu"] = "auto",
                 max_pixels: int | None = -1, prefetch_chunks: int = 2,
                 worker_kind: Literal["auto", "thread", "process"] = "auto", video_processor: Any = None,
                 video_piece_patches: int | None = None, high_bit_depth: Literal["clip", "scale"] = "clip"):
        """workers: decode/resize workers (None: default_workers(); 0: run in the calling thread).
        max_pixels: decompression-bomb limit of `load_image`. prefetch_chunks: how many chunks
        `iter_chunks` lets the workers prepare ahead of the one being consumed (memory bound).
        worker_kind: "thread" (a thread pool), "process" (worker processes for paths and bytes, see the
        module docstring) or "auto" (processes on a CUDA device with >= PROCESS_MIN_WORKERS workers, else
        threads). video_processor: the model's (mmenc.preprocess.video), for video inputs (paths with a
        video extension, video bytes, mmenc.preprocess.video.Video), each cut into pieces of at most
        video_piece_patches rows (None: a quarter of the call's max_batch_patches; run(): whole videos).
        high_bit_depth: 16-bit images, "clip" as transformers (and a warning) or "scale" (see load_image)."""
        for name in ("plan", "resize_one", "patchify", "normalize", "as_pixel_values", "finish"):
            if not callable(getattr(processor, name, None)):
                raise TypeError(f"processor {type(processor).__name__} has no {name}(); expected a "
                                f"mmenc.preprocess processor (QwenVLProcessor, KimiProcessor)")
        if workers is not None and workers < 0:
            raise ValueError(f"workers={workers} must be >= 0 (0: no threads) or None (one per core)")
        if prefetch_chunks < 1:
            raise ValueError(f"prefetch_chunks={prefetch_chunks} must be >= 1")
        self.processor = processor
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.workers = default_workers() if workers is None else workers
        self.max_pixels = max_pixels
        self.prefetch_chunks = prefetch_chunks
        self.decode = choose_decode(decode, self.device)
        self.worker_kind = choose_worker_kind(worker_kind, self.workers, self.device)
        self.resize = choose_resize(resize, self.processor, self.decode, self.worker_kind, self.device)
        self.video, self.video_piece_patches = video_processor, video_piece_patches
        if high_bit_depth not in HIGH_BIT_DEPTH:
            raise ValueError(f"high_bit_depth={high_bit_depth!r} is not valid; expected one of {HIGH_BIT_DEPTH}")
        self.work = ImageWork(processor, self.decode, "cpu" if self.resize == "split" else self.resize,
                              self.device.type, max_pixels, video_processor, high_bit_depth=high_bit_depth)
        self._patchify_in_workers = self.work.patchify_in_workers
        self._pool: ThreadPoolExecutor | None = None
        self._procs: ProcessWorkers | None = None
        self._pool_lock = threading.Lock()  # callers in several threads share one pool
        self.stage_beside = True  # on CUDA, stage on a side stream, beside the tower (False: on the current one)
        self._stream: torch.cuda.Stream | None = None
        self.tally = Tally()  # calling-thread seconds: worker_wait_s (blocked on the workers), stage_s
        self._steps = StepSpans()  # step_spans() records there while it is open

    # -- public ------------------------------------------------------------------------------
    def run(self, items: Iterable[Any], errors: Literal["raise", "skip"] = "raise") -> Preprocessed:
        """All images -> (pixel_values on the device, grid_thw int64 [n, 3], failures).

        errors="raise": every input is tried, then one ImageLoadError lists every failure (index,
        name, reason). errors="skip": failures (LoadFailure) are returned; the n images that
        worked are the inputs whose index is not among them, in input order."""
        _check_errors(errors)
        chunks = list(self._chunks(items, schedule=None))
        failures = [f for c in chunks for f in c.failures]
        if failures and errors == "raise":
            lines = "\n".join(f"  [{f.index}] {f.message}" for f in failures)
            total = sum(len(c.indices) for c in chunks) + len(failures)
            raise ImageLoadError(f"{len(failures)} of {total} images failed to preprocess:\n{lines}")
        return Preprocessed(chunks[0].pixel_values, chunks[0].grid_thw, failures)

    def iter_chunks(self, items: Iterable[Any], *, max_batch_patches: int | None = None,
                    first_chunk_patches: int | None = None, schedule: ChunkSchedule | None = None,
                    errors: Literal["raise", "skip"] = "raise") -> Iterator[Chunk]:
        """Chunks of whole images, in input order, prepared by the workers while the caller uses the
        previous one. `schedule` (mmenc.preprocess.schedule.ChunkSchedule) says how many rows each
        chunk may hold: the first at most schedule.first_patches (at least one image), later ones
        growing up to schedule.max_patches (an image larger than that is a chunk alone). Without a
        schedule: max_batch_patches rows a chunk, the first at most first_chunk_patches (None: no
        smaller first chunk). A chunk is handed out as soon as it is full, or as soon as the next
        image does not fit. errors="raise" raises ImagePreprocessError at the first failing input
        (after the chunks before it were yielded); "skip" reports failures in the chunks."""
        _check_errors(errors)
        if schedule is None:
            if max_batch_patches is None or max_batch_patches < 1:
                raise ValueError(f"max_batch_patches={max_batch_patches} must be >= 1 (or pass schedule=)")
            if first_chunk_patches is not None and first_chunk_patches < 1:
                raise ValueError(f"first_chunk_patches={first_chunk_patches} must be >= 1 "
                                 f"(or None: no smaller first chunk)")
            schedule = ChunkSchedule(max_batch_patches, first_chunk_patches, growth=math.inf)
        for chunk in self._chunks(items, schedule=schedule, raise_first=errors == "raise"):
            yield chunk

    def close(self) -> None:
        """Stop the worker threads and processes (started again by the next call)."""
        with self._pool_lock:
            pool, self._pool = self._pool, None
            procs, self._procs = self._procs, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if procs is not None:
            procs.close()
        self.work.cursors.clear()  # videos' decoders kept for pieces that never came

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- ordering, chunking, staging (calling thread) ---------------------------------------------
    def _chunks(self, items: Iterable[Any], *, schedule: ChunkSchedule | None, raise_first: bool = False
                ) -> Iterator[Chunk]:
        """schedule None: everything in one chunk (run())."""
        max_rows = schedule.max_patches if schedule is not None else None
        piece_rows = self.video_piece_patches or (max(1, max_rows // 4) if max_rows else 1 << 62)
        first = min(piece_rows, schedule.first_limit()) if schedule is not None else None
        units = VideoUnits(self.video, piece_rows, first, lanes=self.workers)  # a long video: its lanes in parallel
        source = units.expand(items)
        limit = schedule.first_limit() if schedule is not None else None
        pending: collections.deque[Future] = collections.deque()
        ready: list[Ready] = []
        failures: list[LoadFailure] = []
        rows, done_rows, done = 0, 0, 0
        exhausted = False
        try:
            while True:
                mean_rows = done_rows / done if done else 0.0
                while not exhausted and self._want_more(len(pending), mean_rows, max_rows):
                    nxt = next(source, None)
                    if nxt is None:
                        exhausted = True
                    else:
                        pending.append(self._submit(*nxt))
                if not pending:
                    break
                with self.tally.time("worker_wait_s"):  # the calling thread blocked on the workers
                    res = pending.popleft().result()
                if units.skip(res):  # the rest of a video that has failed already
                    _release([res] if isinstance(res, Ready) else [])
                    continue
                if isinstance(res, LoadFailure):
                    if raise_first:
                        if ready:  # what came before the failure is still delivered
                            yield self._stage(ready, failures)
                            ready = []
                        raise ImagePreprocessError(res.message.removeprefix(f"{res.name}: "), index=res.index,
                                                   name=res.name)
                    failures.append(res)
                    continue
                done, done_rows = done + 1, done_rows + res.plan.rows
                if ready and limit is not None and rows + res.plan.rows > limit:  # res does not fit
                    yield self._stage(ready, failures)
                    ready, failures, rows, limit = [], [], 0, schedule.next_limit(limit, rows)
                ready.append(res)
                rows += res.plan.rows
                if limit is not None and rows >= limit:  # full: no need to wait for the next image
                    yield self._stage(ready, failures)
                    ready, failures, rows, limit = [], [], 0, schedule.next_limit(limit, rows)
            if ready or failures or schedule is None:
                yield self._stage(ready, failures)
        finally:  # also when the consumer stops early: give back what was prepared for nothing
            _release(ready)
            for f in pending:
                if not f.cancel():
                    f.add_done_callback(_release_result)

    def _want_more(self, n_pending: int, mean_rows: float, max_batch_patches: int | None) -> bool:
        """Submit another image? Always for run(); else keep every worker busy (2 images each) and
        stay under prefetch_chunks chunks in flight, estimated from the images seen so far."""
        if max_batch_patches is None or n_pending < 2 * max(self.workers, 1):
            return True
        return 0 < mean_rows and n_pending * mean_rows < self.prefetch_chunks * max_batch_patches

    def _submit(self, index: int, item: Any) -> Future:
        # "split": a call's first round of images (one per worker) is resized on the device, the rest in the workers
        resize = "device" if self.resize == "split" and index < self.workers else None
        if self.workers == 0 or isinstance(item, LoadFailure):  # (a video that could not be planned)
            fut: Future = Future()
            fut.set_result(item if isinstance(item, LoadFailure) else self._prepare(index, item, resize))
            return fut
        if self.worker_kind == "process" and runs_in_process(item):
            with self._pool_lock:
                if self._procs is None:
                    self._procs = ProcessWorkers(self.work, self.workers)
                procs = self._procs
            return procs.submit(index, item, resize)
        return self._threads().submit(self._prepare, index, item, resize)

    def step_spans(self, sync: bool = False) -> contextlib.AbstractContextManager[list[StepSpan]]:
        """While open, the list it yields gets a StepSpan (mmenc.preprocess.spans) for each image prepared in
        this process ("prepare": decode, plan, resize, in a worker thread or, with workers=0, the calling
        thread) and for each chunk staged ("stage": the calling thread; sync=True: the device synchronised
        before the span ends, so that it holds the staging's device work). For profiling tools
        (benchmarks/e2e_profile.py, preprocess_cpu.py); images prepared in worker processes are not in it."""
        return self._steps.open(self.device if sync and self.device.type == "cuda" else None)

    def _prepare(self, index: int, item: Any, resize: str | None = None) -> Ready | LoadFailure:
        """One image in a worker thread (or the calling thread with workers=0)."""
        with self._steps.span("prepare"):
            return self.work.prepare(index, item, resize)

    def _threads(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="mmenc-preprocess")
            return self._pool

    def _stage(self, ready: list[Ready], failures: list[LoadFailure]) -> Chunk:
        """Move the chunk's uint8 images to the device (one non-blocking copy each), finish them there."""
        self.tally.add(chunks=1, images=len(ready))
        with self.tally.time("stage_s"), self._steps.span("stage"):  # calling-thread time (device work is only queued)
            try:
                side = self._side_stream()
                return self._stage_now(ready, failures) if side is None else self._stage_beside(side, ready, failures)
            finally:  # every image was copied away (pinned memory, or the normalized output)
                _release(ready)

    def _side_stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream that stages chunks (None: they are staged on the current stream)."""
        if not self.stage_beside or self.device.type != "cuda" or self._patchify_in_workers:
            return None
        with self._pool_lock:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            return self._stream

    def _stage_beside(self, side: torch.cuda.Stream, ready: list[Ready], failures: list[LoadFailure]) -> Chunk:
        """_stage_now's device work (copies, resize, normalize) queued on the side stream, so that it runs
        while the tower's previous call still runs on the current stream; the current stream waits for
        it before anything queued later (the tower call that takes this chunk). Device tensors made here
        are used on the side stream only, except the output, which is marked as used by the current
        stream (its memory is not reused before that stream is done with it)."""
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(side):
            chunk = self._stage_now(ready, failures)
        current.wait_stream(side)
        if chunk.pixel_values.device.type == "cuda":
            chunk.pixel_values.record_stream(current)
        return chunk

    def _stage_now(self, ready: list[Ready], failures: list[LoadFailure]) -> Chunk:
        failures = sorted(failures, key=lambda f: f.index)
        if self._patchify_in_workers:  # the workers normalize each image into its rows of one output
            procs = [self._processor_of(r) for r in ready]
            pixel_values, grid_thw = finish_patches(self.processor, [r.pixels for r in ready], [r.plan for r in ready],
                                                    normalize_parts=lambda jobs: self._normalize_parts(jobs, procs),
                                                    normalizers=procs)
            return Chunk(pixel_values, grid_thw, [r.index for r in ready], failures, _videos(ready))
        images: list[torch.Tensor | None] = [None] * len(ready)
        plain = [i for i, r in enumerate(ready) if not r.encoded]
        for i, t in zip(plain, to_device_each([ready[i].pixels for i in plain], self.device)):
            images[i] = t
        jpegs = [i for i, r in enumerate(ready) if r.encoded]
        for i, t in zip(jpegs, gpu_decode.decode_jpegs([ready[i].pixels for i in jpegs], self.device)):
            if t is None:  # nvJPEG refused it: the CPU path decodes it (or names the failure)
                res = self._prepare_cpu(ready[i])
                if isinstance(res, LoadFailure):
                    failures.append(res)
                    continue
                t = res
            images[i] = t
        keep = [i for i, t in enumerate(images) if t is not None]
        plans = [ready[i].plan for i in keep]
        resized = [images[i] if ready[i].resized else self.processor.resize_one(images[i], ready[i].plan)
                   for i in keep]
        procs = [self._processor_of(ready[i]) for i in keep]
        if all(p is self.processor for p in procs):
            pixel_values, grid_thw = self.processor.finish(resized, plans)
        else:  # video pieces among them: each patchified (and normalized) by its own processor
            pixel_values, grid_thw = finish_patches(self.processor, [p.patchify(x, pl) for p, x, pl in
                                                                     zip(procs, resized, plans)], plans, normalizers=procs)
        failures = sorted(failures, key=lambda f: f.index)  # nvJPEG fallbacks may have added some
        return Chunk(pixel_values.to(self.device), grid_thw, [ready[i].index for i in keep], failures,
                     _videos([ready[i] for i in keep]))

    def _processor_of(self, ready: Ready) -> Any:
        return self.video if isinstance(ready.item, VideoPiece) else self.processor

    def _normalize_parts(self, jobs: list[tuple[torch.Tensor, torch.Tensor]], procs: list[Any]) -> None:
        """normalize each (patches, out rows) pair in the worker threads (CPU device), each by its processor."""
        if self.workers == 0:
            for proc, (part, dst) in zip(procs, jobs):
                proc.normalize(part, out=dst)
            return
        pool = self._threads()
        for fut in [pool.submit(proc.normalize, part, out=dst) for proc, (part, dst) in zip(procs, jobs)]:
            fut.result()

    def _prepare_cpu(self, ready: Ready) -> torch.Tensor | LoadFailure:
        name = input_name(ready.item, ready.index)
        try:
            array = load_image(ready.item, index=ready.index, max_pixels=self.max_pixels,
                               high_bit_depth=self.work.high_bit_depth)
        except ImageLoadError as e:
            return LoadFailure(ready.index, name, str(e))
        return to_device_each([array], self.device)[0]


def _videos(ready: list[Ready]) -> tuple:
    """Chunk.videos: each entry's VideoPiece (None for an image); () when there is none."""
    pieces = tuple(r.item if isinstance(r.item, VideoPiece) else None for r in ready)
    return pieces if any(p is not None for p in pieces) else ()


def _release(ready: list[Ready]) -> None:
    """Give the worker processes' shared segments of `ready` back (once; thread-mode images: nothing)."""
    for r in ready:
        if r.release is not None:
            release, r.release = r.release, None
            release()


def _release_result(fut: Future) -> None:
    if not fut.cancelled() and fut.exception() is None and isinstance(fut.result(), Ready):
        _release([fut.result()])


def _check_errors(errors: str) -> None:
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors={errors!r} not supported; expected 'raise' or 'skip'")
