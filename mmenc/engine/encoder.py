"""Encoder: images in, the embeddings a VLM consumes out.

    enc = Encoder("path/to/Qwen2.5-VL-7B-Instruct")          # or a built-in name, load_format="dummy"
    embeddings = enc.encode(["a.jpg", "b.png"])              # list of [tokens_i, out_hidden]
    pixel_values, grid_thw = enc.preprocess(images)          # exactly the HF image processor's output
    flat = enc.encode_pixels(pixel_values, grid_thw)         # [sum tokens_i, out_hidden], image order

Towers with extra outputs (Qwen3-VL's deepstack features) return them with `return_extras=True`:
encode_pixels then gives a TowerOutput (`.embeddings` first, `.extras` beside), encode gives
ImageEmbedding objects. With tensor_parallel_size > 1 the Encoder starts and owns its worker
processes ("weights": the tower sharded over them; "data": one replica each, images split);
results still come back on `device` (cuda:0 by default), as with one GPU.
Under torchrun (RANK/WORLD_SIZE set) each process is one rank instead: every rank builds the
Encoder and calls it with the same inputs, and every rank receives the full result.
"""
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import torch

from mmenc.config import MultiModalConfig
from mmenc.engine.runner import build_tower, default_device
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
                 cuda_graphs: bool = False):
        """model: a local Hugging Face checkpoint folder, or a built-in name (then
        load_format="dummy" is implied: random weights, no files). max_batch_patches bounds one
        tower call; `encode` splits larger inputs into several calls (whole images only).
        compile=True runs the tower's blocks through torch.compile (the first call compiles).
        cuda_graphs=True (CUDA only) replays one CUDA graph per packing seen before (the second
        call with the same image sizes captures it; see mmenc.engine.cuda_graphs)."""
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} must be >= 1")
        self.mm_config = MultiModalConfig(mm_encoder_attn_backend=mm_encoder_attn_backend,
                                          mm_encoder_tp_mode=mm_encoder_tp_mode, compile=compile,
                                          cuda_graphs=cuda_graphs)
        self.device = torch.device(device) if device is not None else default_device()
        self.max_batch_patches = max_batch_patches
        self.tensor_parallel_size = tensor_parallel_size
        tower_args = dict(model=model, load_format=load_format, dtype=dtype, multimodal_config=self.mm_config)
        self._group = None
        self._spmd_mode = None
        from mmenc.distributed import init_from_env

        env = init_from_env(device_type=self.device.type if device is not None else None)
        if env is not None and env.world_size > 1:
            self._init_spmd(env, tower_args, tensor_parallel_size)
        elif tensor_parallel_size > 1:
            from mmenc.engine.parallel import WorkerGroup

            self._group = WorkerGroup(tensor_parallel_size, tower_args, mode=self.mm_config.mm_encoder_tp_mode,
                                      device_type=self.device.type, output_device=self.device)
            self.loaded = self._group.describe()
            # the workers hold the weights; a tower on the meta device (no memory) answers shape questions
            self.loaded.tower = build_tower(**{**tower_args, "dtype": self.loaded.dtype}, device="meta").tower
        else:
            self.loaded = build_tower(**tower_args, device=self.device)
        self.processor = self.loaded.processor
        self.model_name = model

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
                      return_extras: bool = False) -> torch.Tensor | TowerOutput:
        """Embeddings [sum of tokens per image, out_hidden] in image order (dtype of the tower).
        Inputs larger than max_batch_patches run as several tower calls over whole images."""
        if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi's processor) -> one row per patch
            pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
        grid_thw = _check_grid(pixel_values, grid_thw)
        outputs = [self._run(pv, g) for pv, g in self._chunks(pixel_values, grid_thw)]
        out = outputs[0] if len(outputs) == 1 else _concat_outputs(outputs)
        return out if return_extras else out.embeddings

    def encode(self, images: Sequence[Any], return_extras: bool = False,
               errors: Literal["raise", "skip"] = "raise") -> list:
        """One [tokens_i, out_hidden] tensor per image (ImageEmbedding with return_extras).

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
        out = self.encode_pixels(pixel_values, grid_thw, return_extras=True)
        for i, piece in zip(ok, split_per_image(out, self.output_tokens(grid_thw))):
            results[i] = piece if return_extras else piece.embeddings
        return results

    def _init_spmd(self, env, tower_args: dict, tensor_parallel_size: int) -> None:
        """Launched by torchrun (one process per device): this process is one rank; every rank
        constructs the Encoder and calls it with the same inputs, and every rank gets the result."""
        from mmenc.engine.parallel import build_rank_tower, resolve_tower_tp_mode

        if tensor_parallel_size not in (1, env.world_size):
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} but torchrun started {env.world_size} "
                             f"processes; pass {env.world_size} (or leave it at 1) under torchrun")
        mode, reason = resolve_tower_tp_mode(self.mm_config.mm_encoder_tp_mode, tower_args, env.world_size)
        if reason:
            logger.warning("%s", reason)
        self._spmd_mode = mode
        self.device = env.device
        self.tensor_parallel_size = env.world_size
        self.loaded = build_rank_tower(tower_args, mode, env.device)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields."""
        return self.loaded.output_tokens(torch.as_tensor(grid_thw, dtype=torch.int64).cpu())

    def attention_backends(self) -> str:
        """The attention backend(s) the tower's layers chose, e.g. "TORCH_SDPA"."""
        from mmenc.attention.layer import MMEncoderAttention

        tower = getattr(self.loaded, "tower", None)
        if tower is None:
            return getattr(self.loaded, "attention_backends", "unknown")
        names = sorted({m.describe_backend() for m in tower.modules() if isinstance(m, MMEncoderAttention)})
        return ", ".join(names)

    def close(self) -> None:
        if self._group is not None:
            self._group.close()
            self._group = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ----------------------------------------------------------------------------
    def _run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        if self._group is not None:
            return self._group.run(pixel_values, grid_thw)
        if self._spmd_mode is not None:
            from mmenc.engine.parallel import run_rank_tower

            with torch.inference_mode():
                return run_rank_tower(self.loaded, pixel_values, grid_thw, self._spmd_mode)
        from mmenc.engine.runner import run_tower

        return run_tower(self.loaded, pixel_values, grid_thw)

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

