"""Encoder: images in, the embeddings a VLM consumes out.

    enc = Encoder("path/to/Qwen2.5-VL-7B-Instruct")          # a folder, or a Hub id (huggingface_hub's cache)
    enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy")  # random weights, no files
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
Which of these runs the tower is one executor object (mmenc.engine.executors), chosen here once.
Tools and the service use only the Encoder's public surface (docs/engine.md, "For tools and the
service"): what this module defines, `tally`, and what mmenc.engine.tool_surface adds (`launch`, the
CUDA-graph controls, `tower_call_hook`, `input_device`, `dtype`, `tower`, `loaded`, `replace_tower`,
`replace_preprocessor`).
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

from mmenc.engine.checks import check_finite, check_grid
from mmenc.engine.executors import make_executor
from mmenc.engine.outputs import ImageEmbedding
from mmenc.engine.settings import EncoderSettings
from mmenc.engine.stream import stream
from mmenc.engine.tool_surface import ToolSurface
from mmenc.engine.tower import TowerRecipe, empty_output, resolve_checkpoint
from mmenc.engine.videos import VideoEmbedding
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput
from mmenc.preprocess.images import ImageLoadError, LoadFailure
from mmenc.preprocess.inputs import as_items
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.placement import default_workers, usable_cores
from mmenc.preprocess.schedule import ChunkSchedule
from mmenc.tally import Tally

logger = init_logger(__name__)

DEFAULT_MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"


class EncoderClosedError(RuntimeError):
    """An Encoder was asked to encode after close()."""


class Encoder(ToolSurface):
    def __init__(self, model: str | None = None, settings: EncoderSettings | None = None, **options):
        """model: a local Hugging Face checkpoint folder, or a Hub id ("org/name") resolved through
        huggingface_hub (the local cache first, HF_HUB_OFFLINE honoured; a download fetches only
        config.json, the processor configs and the shards holding the tower's tensors). load_format:
        "auto" reads the checkpoint's weights; "dummy" gives random weights (a built-in name then needs
        no files; `random_weights` says so). None: the built-in DEFAULT_MODEL with random weights (a
        demo that runs offline). settings: an EncoderSettings (mmenc.engine.settings: every option,
        what it does, its command-line flag), and/or its fields as keyword arguments, which win over it:
        dtype, device, load_format, tensor_parallel_size, mm_encoder_tp_mode, mm_encoder_attn_backend,
        linear_backend, quantization, fused_kernels, custom_ops, compile, cuda_graphs, batch_invariant, max_batch_patches,
        worker_timeout_s, strict, preprocess_workers, preprocess_worker_kind, preprocess_resize,
        first_chunk_patches, chunk_growth, high_bit_depth, cpu_malloc. Validated once, there (ValueError naming the value).
        Safe to call from many threads: calls run one at a time (docs/engine.md, Threads)."""
        settings = EncoderSettings.merged(settings, options)
        if model is None:
            model, settings = DEFAULT_MODEL, dataclasses.replace(settings, load_format="dummy")
        self.settings, self.mm_config = settings, settings.mm_config
        self.max_batch_patches, self.strict, self.model_name = settings.max_batch_patches, settings.strict, str(model)
        self.first_chunk_patches, self.chunk_growth = settings.first_call_patches, settings.chunk_growth
        self.chunks_in_flight = 2  # tower calls the host may queue before reading the oldest's result
        self.tally = Tally()  # seconds of encode/encode_iter: chunk_wait_s, launch_s, device_wait_s, consumer_s
        checkpoint = resolve_checkpoint(self.model_name, settings.load_format)  # a Hub id: once, here, not per worker
        self._recipe = TowerRecipe(dict(model=checkpoint, load_format=settings.load_format, dtype=settings.dtype,
                                        multimodal_config=self.mm_config))
        device = torch.device(settings.device) if settings.device is not None else None
        self._executor = make_executor(self._recipe, device, settings.tensor_parallel_size,
                                       self.mm_config.mm_encoder_tp_mode, settings.worker_timeout_s)
        self.device, self.tensor_parallel_size = self._executor.device, self._executor.tensor_parallel_size
        if self.device.type == "cpu":  # before the first call: e.g. glibc's malloc keeping freed blocks
            from mmenc.platforms import platform_for

            platform_for(self.device).prepare_host(settings.cpu_malloc)
        self._loaded = self._executor.loaded  # read as `loaded` (ToolSurface)
        self.processor = self.loaded.processor
        workers = default_workers(self.device) if settings.preprocess_workers is None else settings.preprocess_workers
        self.preprocessor = Preprocessor(self.processor, device=self.input_device, workers=workers,
                                         worker_kind=settings.preprocess_worker_kind, resize=settings.preprocess_resize,
                                         video_processor=self.video_processor, high_bit_depth=settings.high_bit_depth)
        logger.info("threads: %s", self.threads())
        self._lock = threading.Lock()  # one call at a time: results can never cross between threads
        self._closed = False  # close() was called: encoding raises EncoderClosedError
        self._empty: TowerOutput | None = None
        self._text = None  # the TextEncoder, built by the first embed_text
        self._hooks: list = []  # tower_call_hook's, innermost last
        self._graphs_off = 0  # graphs_off() depth: > 0 runs the tower without its CUDA graphs

    # -- the three steps --------------------------------------------------------------------
    def preprocess(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values float32 [patches, C*tp*p*p] and grid_thw int64 [N, 3], as the model's HF
        image processor gives them. Inputs: paths, PIL images, numpy arrays (see mmenc.preprocess); one
        image alone (a path, bytes, a PIL image, an [H, W(, C)] array) counts as a list of one."""
        return self.processor(list(as_items(images)))

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
        self._check_open("encode_pixels")
        if pooled:
            out = self.encode_pixels(pixel_values, grid_thw, return_extras=True)
            vectors = self.pool(out.embeddings, grid_thw)
            return TowerOutput(out.embeddings, {**out.extras, "pooled": vectors}) if return_extras else vectors
        if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi's processor) -> one row per patch
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        grid_thw = check_grid(pixel_values, grid_thw)
        with self._lock:
            if grid_thw.shape[0] == 0:
                out = self._empty_output()
            else:
                out = self._run_chunks(pixel_values, grid_thw)
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
    def random_weights(self) -> bool:
        """True when the tower runs random weights (load_format="dummy"): its embeddings mean nothing."""
        return self.loaded.load_format == "dummy"

    @property
    def weights(self) -> str:
        """Where the weights come from, as outputs state it: "checkpoint", or "random" (load_format="dummy")."""
        return "random" if self.random_weights else "checkpoint"

    @property
    def checkpoint_folder(self):
        """The checkpoint folder read (a Hub id's snapshot in the huggingface_hub cache), or None (built-in)."""
        return self.loaded.folder

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
        self._check_open("embed_text")
        self._text_encoder()
        with self._lock:
            return self._text.encode(list(texts) if not isinstance(texts, str) else texts)

    def _text_encoder(self):
        """The TextEncoder, built on first use (ValueError for a checkpoint without a text tower)."""
        if self._text is None:
            if self.loaded.load_format != "auto":
                raise ValueError(f"embed_text: {self.model_name!r} has random weights and no tokenizer files "
                                 f"(load_format='dummy'); pass a CLIPModel / SiglipModel / Siglip2Model checkpoint "
                                 f"folder")
            from mmenc.engine.text import TextEncoder

            self._text = TextEncoder.from_checkpoint(self.loaded.folder, self.device, self.loaded.dtype)
        return self._text

    def text_tokens(self, texts: Sequence[str]) -> list[int]:
        """How many tokens each text is to the text tower (the tokenizer's, truncated, without padding)."""
        return self._text_encoder().token_counts(list(texts))

    def encode(self, images: Sequence[Any], return_extras: bool = False,
               errors: Literal["raise", "skip"] = "raise", pooled: bool = False) -> list:
        """One [tokens_i, out_hidden] tensor per image (ImageEmbedding with return_extras), on the
        tower's device. Inputs: a sequence of paths, bytes, PIL images, numpy arrays (see mmenc.preprocess);
        one input alone (`encode("cat.jpg")`) is a list of one, and so is its result; videos
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
        self._check_open("encode")
        items = list(as_items(images))
        results: list = [None] * len(items)
        failures: list[LoadFailure] = []
        for index, value in stream(self, items, stop_on_failure=errors == "raise", pooled=pooled):
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
        self._check_open("encode_iter")
        for index, value in stream(self, as_items(images), stop_on_failure=False):
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
        return self._executor.attention_backends()

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

    def warm_up(self) -> str:
        """Build now the kernels a first large tower call would build, so that a server's first request does
        not wait for them: on a CPU, the compiled RMSNorm and QuickGELU (mmenc.layers.compiled_kernels; a few
        seconds, once per process and dtype). Returns what was done, for the log."""
        self._check_open("warm_up")
        from mmenc.layers.compiled_kernels import warm

        start = time.perf_counter()
        with self._lock:
            kernels = warm(self.loaded.tower)
        if not kernels:
            return "nothing to warm up"
        return f"compiled {', '.join(kernels)} in {time.perf_counter() - start:.1f} s"

    def close(self) -> None:
        """Stop the preprocessing threads and the worker processes, if any (also on `with` exit). Idempotent;
        afterwards every encode / encode_iter / encode_pixels / embed_text call raises EncoderClosedError."""
        self._closed = True
        self.preprocessor.close()
        self._executor.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _check_open(self, method: str) -> None:
        if self._closed:
            raise EncoderClosedError(f"Encoder({self.model_name!r}).{method}: the encoder is closed (close() was "
                                     f"called, or its `with` block ended); create a new Encoder to encode again")

    def _empty_output(self) -> TowerOutput:
        """The result of a call with zero images (computed once from a meta-device tower)."""
        if self._empty is None:
            meta = TowerRecipe({**self._recipe.tower_args, "dtype": self.loaded.dtype}).meta_tower()
            self._empty = empty_output(meta, self.device)
        return self._empty

