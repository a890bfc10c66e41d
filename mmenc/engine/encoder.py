"""Encoder: images in, the embeddings a VLM consumes out.

    enc = Encoder("path/to/Qwen2.5-VL-7B-Instruct")          # or a built-in name, load_format="dummy"
    embeddings = enc.encode(["a.jpg", "b.png"])              # list of [tokens_i, out_hidden]
    for i, emb in enc.encode_iter(paths):                    # a stream, input order, bounded memory
    pixel_values, grid_thw = enc.preprocess(images)          # exactly the HF image processor's output
    flat = enc.encode_pixels(pixel_values, grid_thw)         # [sum tokens_i, out_hidden], image order

Image-embedding towers (CLIP; SigLIP, SigLIP2 with their attention-pooling head) give one vector per image
with `pooled=True`: encode -> one [dim] tensor per image; encode_pixels -> [N, dim] (with
return_extras: TowerOutput.extras["pooled"]). The head runs in this process (not with worker processes).
Contrastive checkpoints (CLIPModel, SiglipModel, Siglip2Model) embed texts into the same space:
`embed_text(texts)` -> [N, dim] (the checkpoint's tokenizer and text tower, in this process).
Towers with extra outputs (Qwen3-VL's deepstack features) return them with `return_extras=True`:
encode_pixels then gives a TowerOutput (`.embeddings` first, `.extras` beside), encode gives
ImageEmbedding objects. With tensor_parallel_size > 1 the Encoder starts and owns its worker
processes ("weights": the tower sharded over them; "data": one replica each, images split);
results still come back on `device` (cuda:0 by default), as with one GPU.
Under torchrun (RANK/WORLD_SIZE set) each process is one rank instead: every rank builds the
Encoder and calls it with the same inputs, and every rank receives the full result.
Which of these runs the tower is one runner object (mmenc.engine.runners), chosen here once.
`encode` and `encode_iter` are pipelined: the Preprocessor's threads decode and resize the next
chunk while the tower runs this one, and the host reads no device value between chunks
(docs/engine.md, Pipelining).
"""
import dataclasses
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal

import torch

from mmenc.config import MultiModalConfig
from mmenc.engine.checks import check_dtype, check_finite, check_positive_int, check_timeout, finite_flag
from mmenc.engine.inflight import ChunkWindow, Launched
from mmenc.engine.runner import TowerRecipe, empty_output
from mmenc.engine.runners import make_runner
from mmenc.engine.videos import VideoAssembler, VideoEmbedding, entry_tokens
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput
from mmenc.preprocess.images import ImageLoadError, LoadFailure
from mmenc.preprocess.pipeline import Chunk, Preprocessor, default_workers, usable_cores
from mmenc.preprocess.schedule import ChunkSchedule
from mmenc.tally import Tally

logger = init_logger(__name__)

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


@dataclasses.dataclass
class ImageEmbedding:
    """One image's embeddings [tokens, out_hidden] and its share of the tower's extra outputs."""

    embeddings: torch.Tensor
    extras: dict[str, Any]


class Encoder:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str | torch.dtype = "auto",
                 device: str | torch.device | None = None, mm_encoder_attn_backend: str | None = None,
                 load_format: Literal["auto", "dummy"] = "auto", tensor_parallel_size: int = 1,
                 mm_encoder_tp_mode: str = "weights", max_batch_patches: int = 1 << 16, compile: bool = False,
                 cuda_graphs: bool = False, *, worker_timeout_s: float = 600.0, strict: bool = False,
                 preprocess_workers: int | None = None, preprocess_worker_kind: str = "auto",
                 preprocess_resize: str = "auto",
                 batch_invariant: bool = False, linear_backend: str | None = None, quantization: str | None = None,
                 fused_kernels: bool = False, first_chunk_patches: int | None = None, chunk_growth: float = 2.0):
        """model: a local Hugging Face checkpoint folder, or a built-in name (then
        load_format="dummy" is implied: random weights, no files). max_batch_patches bounds one
        tower call; `encode` splits larger inputs into several calls (whole images only).
        compile=True runs the tower's blocks through torch.compile (the first call compiles).
        cuda_graphs=True (CUDA only) replays one CUDA graph per packing seen before (the second
        call with the same image sizes captures it; see mmenc.engine.cuda_graphs).
        worker_timeout_s: with worker processes (tensor_parallel_size > 1), the most one call may
        wait for them before they are declared hung (TimeoutError naming the rank).
        strict: non-finite (NaN/inf) embeddings raise NonFiniteOutputError instead of a warning.
        preprocess_workers: decode/resize workers of `encode`/`encode_iter` (None: one per usable core,
        one for a tower on the CPU (see `threads()`); 0: in the calling thread).
        preprocess_worker_kind: "thread", "process" (paths and bytes are
        decoded in worker processes, so the thread that launches the tower keeps the GIL) or "auto"
        (processes on CUDA with 8 or more workers, else threads). preprocess_resize: "cpu" (in the workers),
        "device" (on the tower's device), "split" (a call's first image per worker on the device, the rest in
        the workers) or "auto" (split with worker processes on CUDA, device with threads).
        See mmenc.preprocess.pipeline.Preprocessor.
        batch_invariant: each image's embedding is bitwise identical whatever else is in the call
        (order, chunking), at some throughput cost (MultiModalConfig.batch_invariant).
        linear_backend: the linears' kernel backend by name ("native", "onednn", "fp8"; None: the
        platform's choice, see `linear_backend()` and docs/linear.md); quantization: None, "fp8" (FP8 on the
        last quarter of the blocks) or "fp8-all" (every linear, below the accuracy bar; docs/linear.md).
        fused_kernels: fused row kernels (residual add + norm, gated activation, FP8 quantization inside
        them) where the platform has them; an error naming why where it has none (docs/kernels.md).
        first_chunk_patches: the first tower call of each `encode`/`encode_iter` takes at most this
        many patches (at least one image), so the tower starts while the rest is still decoded
        (None: max_batch_patches // 16, 4096 by default; max_batch_patches or more: no smaller
        first call). chunk_growth: each later call may take up to this many times the previous
        call's rows, up to max_batch_patches (math.inf: straight to max_batch_patches); the cut
        depends only on the images' sizes, so repeated calls repeat their packings
        (mmenc.preprocess.schedule.ChunkSchedule). See docs/engine.md, Pipelining.
        Safe to call from many threads: calls run one at a time (docs/engine.md, Threads)."""
        check_dtype(dtype)
        check_positive_int("tensor_parallel_size", tensor_parallel_size, "the number of devices, e.g. 2")
        check_positive_int("max_batch_patches", max_batch_patches, "the most patches one tower call takes, e.g. 65536")
        check_timeout("worker_timeout_s", worker_timeout_s)
        self.mm_config = MultiModalConfig(mm_encoder_attn_backend=mm_encoder_attn_backend,
                                          mm_encoder_tp_mode=mm_encoder_tp_mode, compile=compile,
                                          cuda_graphs=cuda_graphs, batch_invariant=batch_invariant,
                                          linear_backend=linear_backend, quantization=quantization,
                                          fused_kernels=fused_kernels)
        if first_chunk_patches is not None:
            check_positive_int("first_chunk_patches", first_chunk_patches,
                               "the most patches of the first tower call of a call, e.g. 4096")
        self.max_batch_patches, self.strict, self.model_name = max_batch_patches, bool(strict), model
        self.first_chunk_patches = min(max_batch_patches, first_chunk_patches if first_chunk_patches is not None
                                       else max(1, max_batch_patches // 16))
        if isinstance(chunk_growth, bool) or not isinstance(chunk_growth, (int, float)) or not chunk_growth >= 1:
            raise ValueError(f"chunk_growth={chunk_growth!r} must be a number >= 1 (2: each tower call of an encode "
                             f"up to twice the previous one; math.inf: the first call, then max_batch_patches)")
        self.chunk_growth = chunk_growth
        self.chunks_in_flight = 2  # tower calls the host may queue before reading the oldest's result
        self.tally = Tally()  # seconds of encode/encode_iter: chunk_wait_s, launch_s, device_wait_s, consumer_s
        self._recipe = TowerRecipe(dict(model=model, load_format=load_format, dtype=dtype,
                                        multimodal_config=self.mm_config))
        self.runner = make_runner(self._recipe, torch.device(device) if device is not None else None,
                                  tensor_parallel_size, self.mm_config.mm_encoder_tp_mode, worker_timeout_s)
        self.device, self.tensor_parallel_size = self.runner.device, self.runner.tensor_parallel_size
        self.loaded = self.runner.loaded
        self.processor = self.loaded.processor
        workers = default_workers(self.device) if preprocess_workers is None else preprocess_workers
        self.preprocessor = Preprocessor(self.processor, device=self.runner.input_device, workers=workers,
                                         worker_kind=preprocess_worker_kind, resize=preprocess_resize,
                                         video_processor=self.video_processor)
        logger.info("threads: %s", self.threads())
        self._lock = threading.Lock()  # one call at a time: results can never cross between threads
        self._empty: TowerOutput | None = None
        self._text = None  # the TextEncoder, built by the first embed_text

    # -- the three steps --------------------------------------------------------------------
    def preprocess(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values float32 [patches, C*tp*p*p] and grid_thw int64 [N, 3], as the model's HF
        image processor gives them. Inputs: paths, PIL images, numpy arrays (see mmenc.preprocess)."""
        return self.processor(list(images))

    @property
    def video_processor(self) -> Any:
        """The model's video processor (mmenc.preprocess.video.VideoProcessor: `vp(path, VideoOptions(fps=2))`
        -> (pixel_values, grid_thw, VideoInfo), as transformers' video processor), or None for a family
        that takes no video."""
        return self.loaded.video_processor

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """One video (a list of frames) -> (pixel_values, grid_thw [1, 3])."""
        return self.processor.preprocess_video(list(frames))

    @torch.inference_mode()
    def encode_pixels(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                      return_extras: bool = False, pooled: bool = False) -> torch.Tensor | TowerOutput:
        """Embeddings [sum of tokens per image, out_hidden] in image order (dtype of the tower).
        Inputs larger than max_batch_patches run as several tower calls over whole images. Zero
        images (grid_thw [0, 3], pixel_values [0, F]) give an empty result [0, out_hidden].
        pooled=True: the tower's pooled image embeddings [N, hidden] instead (see `pool`); with
        return_extras, the TowerOutput carries them as extras["pooled"]."""
        if pooled:
            out = self.encode_pixels(pixel_values, grid_thw, return_extras=True)
            vectors = self.pool(out.embeddings, grid_thw)
            return TowerOutput(out.embeddings, {**out.extras, "pooled": vectors}) if return_extras else vectors
        if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi's processor) -> one row per patch
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        grid_thw = _check_grid(pixel_values, grid_thw)
        with self._lock:
            if grid_thw.shape[0] == 0:
                out = self._empty_output()
            else:
                outputs = [self.runner.run(pv, g) for pv, g in self._chunks(pixel_values, grid_thw)]
                out = outputs[0] if len(outputs) == 1 else _concat_outputs(outputs)
        check_finite(out.embeddings, self.output_tokens(grid_thw), self.strict)
        return out if return_extras else out.embeddings

    @torch.inference_mode()
    def pool(self, embeddings: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The tower's pooling head over its embeddings [tokens, hidden] of grid_thw -> [N, hidden], one
        row per image (SigLIP/SigLIP2 checkpoints with a head). Raises ValueError naming the model otherwise."""
        tower = self.loaded.tower
        if not hasattr(tower, "pool"):
            raise ValueError(f"pooled=True: {self.model_name!r} ({type(tower).__name__}) has no pooled image "
                             f"embedding; use an image-embedding checkpoint (CLIP, SigLIP, SigLIP2), or pooled=False")
        if any(p.device.type == "meta" for p in tower.parameters()):
            raise ValueError(f"pooled=True runs the pooling head in this process, but with tensor_parallel_size="
                             f"{self.tensor_parallel_size} the weights live in worker processes; use "
                             f"tensor_parallel_size=1 (or torchrun) for pooled embeddings")
        return tower.pool(embeddings, torch.as_tensor(grid_thw, dtype=torch.int64).cpu())

    @property
    def pooled_dim(self) -> int | None:
        """The width of `encode(images, pooled=True)`'s vectors (and of `embed_text`'s, for contrastive
        checkpoints), or None when the tower has no pooled image embedding (VLM towers)."""
        return getattr(self.loaded.tower, "pooled_width", None)

    @property
    def supports_text(self) -> bool:
        """Whether `embed_text` can run: the checkpoint is a contrastive image-text model (CLIPModel,
        SiglipModel, Siglip2Model) given as a folder (its text tower and tokenizer are read from it)."""
        from mmenc.models.text import TEXT_KINDS

        text = self.loaded.hf_config.get("text_config")
        return self.loaded.load_format == "auto" and isinstance(text, dict) and text.get("model_type") in TEXT_KINDS

    @torch.inference_mode()
    def embed_text(self, texts: Sequence[str]) -> torch.Tensor:
        """Text embeddings [len(texts), dim] in the space of `encode(images, pooled=True)`: transformers'
        get_text_features on the checkpoint's own tokenizer output (mmenc.engine.text), on `device` in the
        tower's dtype. The text tower is built on first use. ValueError for a checkpoint without one."""
        if self._text is None:
            if self.loaded.load_format != "auto":
                raise ValueError(f"embed_text: {self.model_name!r} has random weights and no tokenizer files "
                                 f"(load_format='dummy'); pass a CLIPModel / SiglipModel / Siglip2Model checkpoint "
                                 f"folder")
            from mmenc.engine.text import TextEncoder

            self._text = TextEncoder.from_checkpoint(self.model_name, self.device, self.loaded.dtype)
        with self._lock:
            return self._text.encode(list(texts) if not isinstance(texts, str) else texts)

    def encode(self, images: Sequence[Any], return_extras: bool = False,
               errors: Literal["raise", "skip"] = "raise", pooled: bool = False) -> list:
        """One [tokens_i, out_hidden] tensor per image (ImageEmbedding with return_extras), on the
        tower's device. Inputs: paths, bytes, PIL images, numpy arrays (see mmenc.preprocess); videos
        (a path with a video extension, a video file's bytes, or mmenc.preprocess.video.Video(path,
        fps=...)) give a VideoEmbedding (embeddings, extras, video: VideoInfo) whatever return_extras.
        pooled=True: one [hidden] pooled embedding per image instead (the tower's pooling head, see
        `pool`; in ImageEmbedding.extras["pooled"] with return_extras).

        Partial failure: every input is tried. errors="raise" raises one ImageLoadError naming every
        input that failed (index, name, reason) and returns nothing (the tower stops at the first
        failure); errors="skip" puts None at the failed positions (each failure logged, named).
        Pipelined in chunks of at most max_batch_patches patches (see encode_iter)."""
        if errors not in ("raise", "skip"):
            raise ValueError(f"errors={errors!r} not supported; expected 'raise' or 'skip'")
        items = list(images)
        results: list = [None] * len(items)
        failures: list[LoadFailure] = []
        for index, value in self._pipeline(items, stop_on_failure=errors == "raise", pooled=pooled):
            if isinstance(value, LoadFailure):
                failures.append(value)
                if errors == "skip":
                    logger.warning("skipped: %s", value.message)  # the message names the input
            else:
                results[index] = value if return_extras or isinstance(value, VideoEmbedding) else (
                    value.extras["pooled"] if pooled else value.embeddings)
        if failures and errors == "raise":
            lines = "\n".join(f"  [{f.index}] {f.message}" for f in failures)
            raise ImageLoadError(f"{len(failures)} of {len(items)} images failed to preprocess:\n{lines}")
        return results

    def encode_iter(self, images: Iterable[Any], return_extras: bool = False
                    ) -> Iterator[tuple[int, torch.Tensor | ImageEmbedding | LoadFailure]]:
        """Stream: (input index, embeddings [tokens, out_hidden] (ImageEmbedding with return_extras)
        or a LoadFailure naming the input and why) for every input, in input order.

        `images` may be any iterable, also an endless generator: it is read only as far as the
        Preprocessor's look-ahead (about 2 images per worker thread and at most prefetch_chunks
        chunks of max_batch_patches patches) beyond the chunk the tower runs, and one chunk's
        results wait to be handed out, so memory stays bounded whatever the stream's length.
        A failing image yields its LoadFailure (also logged) and the stream goes on. Threads: the
        Encoder's lock is held for each tower call only, so other callers' calls interleave
        between chunks; each call's results are its own. Non-finite embeddings are checked once their
        tower call is done, without waiting for later calls: warned up to two chunks later, or, under
        strict=True, before the chunk's results are handed out (NonFiniteOutputError ends the stream).
        Results are device tensors whose tower call may still be running (stream-ordered, as any
        torch op's output)."""
        for index, value in self._pipeline(images, stop_on_failure=False):
            if isinstance(value, LoadFailure):
                logger.warning("skipped: %s", value.message)
                yield index, value
            else:
                yield index, value if return_extras or isinstance(value, VideoEmbedding) else value.embeddings

    @property
    def chunk_schedule(self) -> ChunkSchedule:
        """How `encode`/`encode_iter` cut their inputs into tower calls (first_chunk_patches, then
        growing by chunk_growth up to max_batch_patches)."""
        return ChunkSchedule(self.max_batch_patches, self.first_chunk_patches, self.chunk_growth)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields."""
        return self.loaded.output_tokens(torch.as_tensor(grid_thw, dtype=torch.int64).cpu())

    def attention_backends(self) -> str:
        """The attention backend(s) the tower's layers chose, e.g. "TORCH_SDPA"."""
        return self.runner.attention_backends()

    def threads(self) -> str:
        """How this process's cores are shared, e.g. "2 usable cores; tower: 2 intra-op threads (torch);
        preprocessing: 1 thread worker" (a CPU tower takes every core; its preprocessing one worker)."""
        pre = self.preprocessor
        where = (f"{self.tensor_parallel_size} worker processes" if self.tensor_parallel_size > 1
                 else f"{torch.get_num_threads()} intra-op threads (torch)")
        kind = "in the calling thread" if pre.workers == 0 else (
            f"{pre.workers} {pre.worker_kind} worker{'s' if pre.workers != 1 else ''}")
        return f"{usable_cores()} usable cores; tower on {self.device.type}: {where}; preprocessing: {kind}"

    def linear_backend(self) -> str:
        """The linear backend the tower's linears run on, e.g. "ONEDNN" (the platform's pick unless given)."""
        backend = getattr(self.loaded, "linear_backend", None)
        return backend.name if backend is not None else "unknown"

    def close(self) -> None:
        """Stop the preprocessing threads and the worker processes, if any (also on `with` exit). Idempotent."""
        self.preprocessor.close()
        self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _empty_output(self) -> TowerOutput:
        """The result of a call with zero images (computed once from a meta-device tower)."""
        if self._empty is None:
            meta = TowerRecipe({**self._recipe.tower_args, "dtype": self.loaded.dtype}).meta_tower()
            self._empty = empty_output(meta, self.device)
        return self._empty

    def _pipeline(self, images: Iterable[Any], *, stop_on_failure: bool, pooled: bool = False
                  ) -> Iterator[tuple[int, ImageEmbedding | LoadFailure]]:
        """(index, ImageEmbedding | LoadFailure) in input order. Chunks follow `chunk_schedule`; chunk
        k's results are handed out after chunk k+1's tower call is queued, and the host reads no
        device value on the way except through a ChunkWindow (mmenc.engine.inflight): on CUDA the
        device never waits for the host between chunks while the workers keep up. stop_on_failure:
        no tower call after the first failure (encode with errors="raise" only collects the failures
        then). pooled: each ImageEmbedding also carries extras["pooled"] [hidden] (see `pool`).
        Seconds spent land in self.tally (chunk_wait_s, launch_s, device_wait_s, consumer_s)."""
        chunks = self.preprocessor.iter_chunks(images, schedule=self.chunk_schedule, errors="skip")
        window = ChunkWindow(depth=self.chunks_in_flight, strict=self.strict, tally=self.tally)
        videos = VideoAssembler()  # a long video's pieces, until its last
        failed = False
        try:
            while True:
                with self.tally.time("chunk_wait_s"):  # blocked on the workers, or staging the chunk
                    chunk = next(chunks, None)
                if chunk is None:
                    break
                failed = failed or bool(chunk.failures)
                launched = Launched(chunk)
                if chunk.indices and not (failed and stop_on_failure):
                    with self.tally.time("launch_s"):
                        launched = self._launch(chunk, pooled)
                for done in window.push(launched):
                    yield from self._hand_out(done, videos)
            for done in window.drain():
                yield from self._hand_out(done, videos)
        finally:
            chunks.close()

    def _launch(self, chunk: Chunk, pooled: bool) -> Launched:
        """Queue one chunk's tower call (and its finite flag); nothing here waits for the device."""
        pixel_values = chunk.pixel_values
        if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi's processor) -> one row per patch
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        with self._lock:  # per tower call: other threads' calls interleave between chunks
            out = self.runner.run(pixel_values, chunk.grid_thw)
            if pooled:  # [N, hidden], one row per image: not token-aligned, handed out by _deliver
                out = TowerOutput(out.embeddings, {**out.extras, "pooled": self.pool(out.embeddings, chunk.grid_thw)})
            flag = finite_flag(out.embeddings)  # CUDA calls (a pinned buffer, an event): never beside a capture
        self.tally.add(tower_calls=1, images=len(chunk.indices))
        return Launched(chunk, out, flag, self.output_tokens(chunk.grid_thw))

    def _hand_out(self, launched: Launched, videos: VideoAssembler):
        """_deliver's items, the caller's time between them counted as consumer_s."""
        for item in self._deliver(launched, videos):
            begin = time.perf_counter()
            yield item
            self.tally.add(consumer_s=time.perf_counter() - begin)

    def _deliver(self, launched: Launched, videos: VideoAssembler):
        """One chunk's failures and (if it ran) per-image results, merged in input order (the finite
        check is the ChunkWindow's); a video's pieces go to `videos`, which gives its VideoEmbedding
        after its last piece."""
        chunk, out = launched.chunk, launched.out
        items: list[tuple[int, Any]] = [(f.index, f) for f in chunk.failures]
        for f in chunk.failures:
            videos.fail(f.index)  # nothing for an image; a video's earlier pieces are dropped
        if out is not None:
            extras = dict(out.extras)
            vectors = extras.pop("pooled", None)
            tokens = entry_tokens(chunk.videos, len(chunk.grid_thw), launched.tokens)
            pieces = split_per_image(TowerOutput(out.embeddings, extras), tokens)
            if vectors is not None:
                for piece, vector in zip(pieces, vectors):
                    piece.extras["pooled"] = vector
            for index, piece, video in zip(chunk.indices, pieces, chunk.videos or [None] * len(pieces)):
                if video is not None:
                    self.tally.add(video_frames=len(video.frames))  # progress of long videos (mmenc encode)
                value = piece if video is None else videos.take(index, video, piece)
                if value is not None:
                    items.append((index, value))
        yield from sorted(items, key=lambda pair: pair[0])

    def _chunks(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Split into runs of whole images of at most max_batch_patches patches (one image may exceed it)."""
        sizes = grid_thw[:, :3].prod(-1).tolist()  # t*h*w (LLaVA-NeXT rows add columns after them)
        start_img, start_patch, count = 0, 0, 0
        for i, n in enumerate(sizes):
            if count and count + n > self.max_batch_patches:
                yield pixel_values[start_patch:start_patch + count], grid_thw[start_img:i]
                start_img, start_patch, count = i, start_patch + count, 0
            count += n
        yield pixel_values[start_patch:start_patch + count], grid_thw[start_img:]


def split_per_image(out: TowerOutput, tokens: list[int]) -> list[ImageEmbedding]:
    """Cut a batch's TowerOutput into one ImageEmbedding per image (tensor extras are cut alike)."""
    embeddings = out.embeddings.split(tokens)
    pieces = [ImageEmbedding(e, {}) for e in embeddings]
    for key, value in out.extras.items():
        if isinstance(value, torch.Tensor):
            for p, v in zip(pieces, value.split(tokens)):
                p.extras[key] = v
        elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            per_level = [v.split(tokens) for v in value]
            for i, p in enumerate(pieces):
                p.extras[key] = [level[i] for level in per_level]
        else:
            for p in pieces:
                p.extras[key] = value
    return pieces


def _concat_outputs(outputs: list[TowerOutput]) -> TowerOutput:
    extras = {}
    for key, value in outputs[0].extras.items():
        if isinstance(value, torch.Tensor):
            extras[key] = torch.cat([o.extras[key] for o in outputs])
        elif isinstance(value, (list, tuple)):
            extras[key] = [torch.cat([o.extras[key][i] for o in outputs]) for i in range(len(value))]
        else:
            extras[key] = value
    return TowerOutput(torch.cat([o.embeddings for o in outputs]), extras)


def _check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64, device="cpu")
    if grid_thw.dim() != 2 or grid_thw.shape[1] < 3:
        raise ValueError(f"grid_thw must be [N, 3] (t, h, w per image; anyres families add the image size: "
                         f"[N, 5]), got shape {tuple(grid_thw.shape)}")
    if (grid_thw <= 0).any():
        raise ValueError(f"grid_thw entries must be positive, got {grid_thw.tolist()}")
    total = int(grid_thw[:, :3].prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != total:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grid_thw.tolist()} "
                         f"needs [{total}, C*temporal_patch*patch*patch]")
    return grid_thw

