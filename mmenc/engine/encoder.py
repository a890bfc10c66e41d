"""Encoder: images in, the embeddings a VLM consumes out.

    enc = Encoder("path/to/Qwen2.5-VL-7B-Instruct")          # or a built-in name, load_format="dummy"
    embeddings = enc.encode(["a.jpg", "b.png"])              # list of [tokens_i, out_hidden]
    pixel_values, grid_thw = enc.preprocess(images)          # exactly the HF image processor's output
    flat = enc.encode_pixels(pixel_values, grid_thw)         # [sum tokens_i, out_hidden], image order

Image-embedding towers (SigLIP, SigLIP2 with their attention-pooling head) give one vector per image
with `pooled=True`: encode -> one [hidden] tensor per image; encode_pixels -> [N, hidden] (with
return_extras: TowerOutput.extras["pooled"]). The head runs in this process (not with worker processes).
Towers with extra outputs (Qwen3-VL's deepstack features) return them with `return_extras=True`:
encode_pixels then gives a TowerOutput (`.embeddings` first, `.extras` beside), encode gives
ImageEmbedding objects. With tensor_parallel_size > 1 the Encoder starts and owns its worker
processes ("weights": the tower sharded over them; "data": one replica each, images split);
results still come back on `device` (cuda:0 by default), as with one GPU.
Under torchrun (RANK/WORLD_SIZE set) each process is one rank instead: every rank builds the
Encoder and calls it with the same inputs, and every rank receives the full result.
Which of these runs the tower is one runner object (mmenc.engine.runners), chosen here once.
"""
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any, Literal

import torch

from mmenc.config import MultiModalConfig
from mmenc.engine.checks import check_dtype, check_finite, check_positive_int, check_timeout
from mmenc.engine.runner import TowerRecipe, empty_output
from mmenc.engine.runners import make_runner
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput

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
                 cuda_graphs: bool = False, *, worker_timeout_s: float = 600.0, strict: bool = False):
        """model: a local Hugging Face checkpoint folder, or a built-in name (then
        load_format="dummy" is implied: random weights, no files). max_batch_patches bounds one
        tower call; `encode` splits larger inputs into several calls (whole images only).
        compile=True runs the tower's blocks through torch.compile (the first call compiles).
        cuda_graphs=True (CUDA only) replays one CUDA graph per packing seen before (the second
        call with the same image sizes captures it; see mmenc.engine.cuda_graphs).
        worker_timeout_s: with worker processes (tensor_parallel_size > 1), the most one call may
        wait for them before they are declared hung (TimeoutError naming the rank).
        strict: non-finite (NaN/inf) embeddings raise NonFiniteOutputError instead of a warning.
        Safe to call from many threads: calls run one at a time (docs/engine.md, Threads)."""
        check_dtype(dtype)
        check_positive_int("tensor_parallel_size", tensor_parallel_size, "the number of devices, e.g. 2")
        check_positive_int("max_batch_patches", max_batch_patches, "the most patches one tower call takes, e.g. 65536")
        check_timeout("worker_timeout_s", worker_timeout_s)
        self.mm_config = MultiModalConfig(mm_encoder_attn_backend=mm_encoder_attn_backend,
                                          mm_encoder_tp_mode=mm_encoder_tp_mode, compile=compile,
                                          cuda_graphs=cuda_graphs)
        self.max_batch_patches, self.strict, self.model_name = max_batch_patches, bool(strict), model
        self._recipe = TowerRecipe(dict(model=model, load_format=load_format, dtype=dtype,
                                        multimodal_config=self.mm_config))
        self.runner = make_runner(self._recipe, torch.device(device) if device is not None else None,
                                  tensor_parallel_size, self.mm_config.mm_encoder_tp_mode, worker_timeout_s)
        self.device, self.tensor_parallel_size = self.runner.device, self.runner.tensor_parallel_size
        self.loaded = self.runner.loaded
        self.processor = self.loaded.processor
        self._lock = threading.Lock()  # one call at a time: results can never cross between threads
        self._empty: TowerOutput | None = None

    # -- the three steps --------------------------------------------------------------------
    def preprocess(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values float32 [patches, C*tp*p*p] and grid_thw int64 [N, 3], as the model's HF
        image processor gives them. Inputs: paths, PIL images, numpy arrays (see mmenc.preprocess)."""
        return self.processor(list(images))

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
                             f"embedding; use a SigLIP or SigLIP2 checkpoint, or pooled=False")
        if any(p.device.type == "meta" for p in tower.parameters()):
            raise ValueError(f"pooled=True runs the pooling head in this process, but with tensor_parallel_size="
                             f"{self.tensor_parallel_size} the weights live in worker processes; use "
                             f"tensor_parallel_size=1 (or torchrun) for pooled embeddings")
        return tower.pool(embeddings, torch.as_tensor(grid_thw, dtype=torch.int64).cpu())

    def encode(self, images: Sequence[Any], return_extras: bool = False,
               errors: Literal["raise", "skip"] = "raise", pooled: bool = False) -> list:
        """One [tokens_i, out_hidden] tensor per image (ImageEmbedding with return_extras); with
        pooled=True one [hidden] pooled embedding per image (in ImageEmbedding.extras["pooled"] with
        return_extras).

        Partial failure: every input is loaded first. errors="raise" raises one ImageLoadError
        naming every input that failed, before any encoding; errors="skip" encodes the others and
        puts None at the failed positions (the failures are logged with their reasons)."""
        from mmenc.preprocess.images import load_images

        loaded, failures = load_images(list(images), errors=errors)
        for f in failures:
            logger.warning("skipped: %s", f.message)  # the message names the input
        results: list = [None] * len(images)
        failed = {f.index for f in failures}
        ok = [i for i in range(len(images)) if i not in failed]
        if not loaded:
            return results
        pixel_values, grid_thw = self.processor(loaded)
        out = self.encode_pixels(pixel_values, grid_thw, return_extras=True, pooled=pooled)
        vectors = out.extras.pop("pooled", None)  # [N, hidden], one row per image
        for k, (i, piece) in enumerate(zip(ok, split_per_image(out, self.output_tokens(grid_thw)))):
            if vectors is not None:
                piece.extras["pooled"] = vectors[k]
            results[i] = piece if return_extras else (piece.extras["pooled"] if pooled else piece.embeddings)
        return results

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields."""
        return self.loaded.output_tokens(torch.as_tensor(grid_thw, dtype=torch.int64).cpu())

    def attention_backends(self) -> str:
        """The attention backend(s) the tower's layers chose, e.g. "TORCH_SDPA"."""
        return self.runner.attention_backends()

    def close(self) -> None:
        """Stop the worker processes, if any (also on `with` exit). Idempotent."""
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

    def _chunks(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """Split into runs of whole images of at most max_batch_patches patches (one image may exceed it)."""
        sizes = grid_thw.prod(-1).tolist()
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
    if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
        raise ValueError(f"grid_thw must be [N, 3] (t, h, w per image), got shape {tuple(grid_thw.shape)}")
    if (grid_thw <= 0).any():
        raise ValueError(f"grid_thw entries must be positive, got {grid_thw.tolist()}")
    total = int(grid_thw.prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != total:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grid_thw.tolist()} "
                         f"needs [{total}, C*temporal_patch*patch*patch]")
    return grid_thw

