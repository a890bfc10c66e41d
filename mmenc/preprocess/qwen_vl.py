"""Qwen2-VL-style patch processors: Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4.1V.

All four share one algorithm (transformers' Qwen2VLImageProcessor / Glm4vImageProcessor and the
Qwen2VL / Qwen3VL / Glm4v video processors) and differ only in constants:

  1. resize each image/video to (h, w), multiples of factor = patch_size * merge_size, by
     `smart_resize` ("spatial" rule, Qwen2-VL) or `smart_resize_temporal` ("temporal" rule, GLM-4.1V
     images and Qwen3-VL / GLM-4.1V videos: frames count in the pixel budget, tiny sides upscaled);
  2. bicubic resize, rescale, normalize (ops.py; backend "torchvision" or "pil");
  3. pad the frame axis to a multiple of temporal_patch_size with copies of the last frame (a still
     image becomes temporal_patch_size identical frames);
  4. patches in (t, h/m, w/m, m, m) order, each flattened as (C, tp, p, p).

Output: pixel_values float32 [sum_i t_i*h_i*w_i, C*tp*p*p], grid_thw int64 [N, 3], input order.
Per image (what mmenc.preprocess.pipeline uses): `plan` -> `resize_one` -> `finish`.
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, resize_exact
from mmenc.preprocess.images import load_image, process_by_size, size_text
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL rule: (h, w) multiples of factor, h*w within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {size_text(width, height)}: aspect ratio must be at most 200 "
                         f"(got {max(height, width) / min(height, width):.1f}); crop or pad it first")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def smart_resize_temporal(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                          min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """GLM-4.1V / Qwen3-VL-video rule: the budget counts frames; sides below factor are upscaled."""
    if num_frames < temporal_factor:
        raise ValueError(f"video of {num_frames} frames: needs at least temporal_patch_size="
                         f"{temporal_factor} frames")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image {size_text(width, height)}: aspect ratio must be at most 200 "
                         f"(got {max(height, width) / min(height, width):.1f}); crop or pad it first")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    t = round(num_frames / temporal_factor) * temporal_factor
    if t * h * w > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif t * h * w < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


@dataclasses.dataclass(frozen=True)
class QwenVLProcessorConfig:
    """Constants of one family. Pixel bounds are total pixels per image (per video for "temporal")."""

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    image_rule: str = "spatial"  # "spatial" (Qwen) or "temporal" (GLM-4.1V)
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 28 * 28 * 768
    video_rule: str = "spatial"
    video_sampling: str = "none"  # "none": every frame given; "qwen3": Qwen3-VL's default
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "temporal_patch_size", "merge_size", "min_pixels", "max_pixels",
                                   "video_min_pixels", "video_max_pixels"))
        for f in ("image_rule", "video_rule"):
            if getattr(self, f) not in ("spatial", "temporal"):
                raise ValueError(f"{f}={getattr(self, f)!r}; expected 'spatial' or 'temporal'")
        if self.video_sampling not in ("none", "qwen3"):
            raise ValueError(f"video_sampling={self.video_sampling!r}; expected 'none' or 'qwen3'")
        if len(self.image_mean) != len(self.image_std):
            raise ValueError(f"image_mean {self.image_mean} and image_std {self.image_std} differ in length")
        ops.check_backend(self.backend)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                *, defaults: "QwenVLProcessorConfig | None" = None, **overrides) -> "QwenVLProcessorConfig":
        """From a preprocessor_config.json dict (and optionally video_preprocessor_config.json).

        Reads min_pixels/max_pixels or size={"shortest_edge", "longest_edge"} (transformers 5),
        patch/temporal/merge sizes, image_mean/std, rescale_factor, do_* flags. Missing keys keep
        `defaults` (the family preset). `overrides` (e.g. backend="pil") win over everything.
        """
        base = defaults or cls()
        kw: dict[str, Any] = {}
        d, video = dict(d or {}), dict(video or {})
        for src, lo, hi in ((d, "min_pixels", "max_pixels"), (video, "video_min_pixels", "video_max_pixels")):
            size = src.get("size") or {}
            if isinstance(size, Mapping):
                if size.get("shortest_edge") is not None:
                    kw[lo] = int(size["shortest_edge"])
                if size.get("longest_edge") is not None:
                    kw[hi] = int(size["longest_edge"])
            if src.get("min_pixels") is not None:
                kw[lo] = int(src["min_pixels"])
            if src.get("max_pixels") is not None:
                kw[hi] = int(src["max_pixels"])
        for k in ("patch_size", "temporal_patch_size", "merge_size", "do_resize", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = d[k]
        if d.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(d["rescale_factor"])
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                v = d[k]
                kw[k] = tuple(float(x) for x in (v if isinstance(v, (list, tuple)) else [v] * 3))
        kw.update(overrides)
        return dataclasses.replace(base, **kw)


class QwenVLProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C*tp*p*p], grid_thw int64 [N, 3]); see module docstring.

    Inputs may be anything `mmenc.preprocess.load_image` accepts (paths, bytes, PIL, numpy).
    device: where resize/normalize run ("cpu" default; results on another device match
    transformers run on that device with backend "torchvision"). finish: PatchProcessor's.
    """

    config_class = QwenVLProcessorConfig

    def target_size(self, height: int, width: int, num_frames: int = 1, video: bool = False) -> tuple[int, int]:
        c = self.config
        lo, hi = (c.video_min_pixels, c.video_max_pixels) if video else (c.min_pixels, c.max_pixels)
        rule = c.video_rule if video else c.image_rule
        if rule == "temporal":
            t = num_frames if video else c.temporal_patch_size
            return smart_resize_temporal(t, height, width, c.temporal_patch_size, c.factor, lo, hi)
        return smart_resize(height, width, c.factor, lo, hi)

    def _resize_normalize(self, frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """uint8 [B, T, C, H, W] -> float32 [B*T, C, h, w]: resized (do_resize) to height x width, rescaled
        and normalized; ValueError unless h and w are multiples of patch_size * merge_size."""
        c = self.config
        x = frames.flatten(0, 1)
        if c.do_resize:
            x = ops.resize_uint8(x, height, width, c.backend)
        x = ops.rescale_normalize(x, rescale_factor=c.rescale_factor, mean=c.image_mean, std=c.image_std,
                                  do_rescale=c.do_rescale, do_normalize=c.do_normalize, backend=c.backend)
        h, w = x.shape[-2:]
        if h % c.factor or w % c.factor:
            raise ValueError(f"resized size {size_text(w, h)} is not a multiple of patch_size*merge_size={c.factor}; "
                             f"keep do_resize=True or pass images of such sizes")
        return x

    def _to_patches(self, frames: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, list[int]]:
        """uint8 [B, T, C, H, W] -> float32 [B, t*gh*gw, C*tp*p*p], [t, gh, gw]."""
        c = self.config
        b, t, ch = frames.shape[:3]
        x = self._resize_normalize(frames, height, width)
        h, w = x.shape[-2:]
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        x = x.view(b, t, ch, h, w)
        if pad := -t % tp:  # repeat the last frame
            x = torch.cat([x, x[:, -1:].expand(b, pad, ch, h, w)], dim=1)
        gt, gh, gw = x.shape[1] // tp, h // p, w // p
        x = x.view(b, gt, tp, ch, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)  # b, t, h/m, w/m, m, m, C, tp, p, p
        return x.reshape(b, gt * gh * gw, ch * tp * p * p), [gt, gh, gw]

    # -- per image: plan (size only) -> resize_one (a worker thread or the GPU) -> finish (device) --
    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        """What preprocessing does to one still image of height x width; raises ImagePreprocessError
        (naming `name` / image #index) if it cannot be preprocessed (e.g. aspect ratio over 200)."""
        c = self.config
        try:
            h, w = self.target_size(height, width) if c.do_resize else (height, width)
        except ValueError as e:
            raise ImagePreprocessError(str(e), index=index, name=name) from e
        if h % c.factor or w % c.factor:
            raise ImagePreprocessError(f"size {size_text(w, h)} is not a multiple of patch_size*merge_size={c.factor}; "
                                       f"keep do_resize=True or pass images of such sizes", index=index, name=name)
        p = c.patch_size
        return ImagePlan(size=(height, width), resize=(h, w), padded=(h, w), grid=(1, h // p, w // p),
                         rows=(h // p) * (w // p))

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, *plan.padded]. On the CPU: the processor's backend, as
        `__call__` does; on another device (backend "torchvision"): `resize_uint8_exact`, the same
        bytes as torch's CPU kernel (so the same result as on the CPU, not torch's float GPU path)."""
        h, w = plan.resize
        if not self.config.do_resize:
            return image
        return resize_exact(image, h, w, self.config.backend)

    @property
    def row_shape(self) -> tuple[int, int]:
        """Shape of one row of `patchify`'s output: (C, tp*p*p)."""
        c = self.config
        return len(c.image_mean), c.temporal_patch_size * c.patch_size ** 2

    def patchify(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """Resized uint8 [C, h, w] -> uint8 [rows, C, tp*p*p]: patches in (h/m, w/m, m, m) order, each
        (C, tp, p, p) with the still image repeated tp times (one copy; still uint8)."""
        c = self.config
        p, m, tp = c.patch_size, c.merge_size, c.temporal_patch_size
        ch, h, w = image.shape
        gh, gw = h // p, w // p
        x = image.contiguous().view(ch, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
        x = x.unsqueeze(5).expand(gh // m, gw // m, m, m, ch, tp, p, p)  # h/m, w/m, m, m, C, tp, p, p
        return x.reshape(gh * gw, ch, tp * p * p)

    def normalize(self, patches: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [P, C, tp*p*p] -> float32 [P, C, tp*p*p] (into `out` if given): rescale + normalize,
        elementwise with the backend's exact arithmetic, so the same values as `__call__`."""
        c = self.config
        x = ops.rescale_normalize(patches.unsqueeze(-1), rescale_factor=c.rescale_factor, mean=c.image_mean,
                                  std=c.image_std, do_rescale=c.do_rescale, do_normalize=c.do_normalize,
                                  backend=c.backend, out=None if out is None else out.unsqueeze(-1))
        return x.squeeze(-1)

    def as_pixel_values(self, x: torch.Tensor) -> torch.Tensor:
        """normalize's float32 [P, C, tp*p*p] -> pixel_values [P, C*tp*p*p] (a view)."""
        return x.reshape(x.shape[0], x.shape[1] * x.shape[2])

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """images: list of inputs -> (pixel_values float32 [P, C*tp*p*p], grid_thw int64 [N, 3])."""
        def process(arrays):
            h0, w0 = arrays[0].shape[:2]
            h, w = self.target_size(h0, w0) if self.config.do_resize else (h0, w0)
            return self._to_patches(ops.stack_hwc(arrays, self.device)[:, None], h, w)

        return process_by_size(images, process)

    def sample_frames(self, num_frames: int) -> np.ndarray:
        """Indices of the frames kept from a plain list of `num_frames` frames (no metadata)."""
        if self.config.video_sampling == "qwen3":
            # Qwen3VLVideoProcessor default: fps=2 assuming 24 fps, 4..768 frames, uniform indices.
            n = min(max(int(num_frames / 24 * 2), 4), 768, num_frames)
            return np.linspace(0, num_frames - 1, n).round().astype(int)
        return np.arange(num_frames)

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """frames of one video (same size) -> (pixel_values [t*gh*gw, C*tp*p*p], grid_thw [1, 3]).

        t = ceil(kept_frames / temporal_patch_size); the last frame is repeated to fill.
        """
        if len(frames) == 0:
            raise ValueError("frames is empty; pass at least one frame")
        keep = self.sample_frames(len(frames))
        arrays = [load_image(frames[i], index=int(i)) for i in keep]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"video frames differ in size: {sorted(shapes)}; all frames must match")
        h0, w0 = arrays[0].shape[:2]
        h, w = self.target_size(h0, w0, len(arrays), video=True) if self.config.do_resize else (h0, w0)
        video = ops.stack_hwc(arrays, self.device)[None]  # [1, T, C, H, W]
        patches, grid = self._to_patches(video, h, w)
        return patches[0], torch.tensor([grid], dtype=torch.int64)


# Family presets: what transformers uses when the checkpoint's config leaves a key out.
QWEN2_VL = QwenVLProcessorConfig()
QWEN3_VL = QwenVLProcessorConfig(
    patch_size=16, image_mean=HALF, image_std=HALF, min_pixels=65536, max_pixels=16777216,
    video_min_pixels=128 * 32 * 32, video_max_pixels=32 * 32 * 768, video_rule="temporal",
    video_sampling="qwen3")
GLM4V = QwenVLProcessorConfig(
    min_pixels=112 * 112, max_pixels=28 * 28 * 15000, image_rule="temporal",
    video_min_pixels=112 * 112, video_max_pixels=28 * 28 * 2 * 30000, video_rule="temporal")


def qwen2_vl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> QwenVLProcessor:
    """Qwen2-VL and Qwen2.5-VL (same processor class and defaults in transformers)."""
    return QwenVLProcessor(QwenVLProcessorConfig.from_hf(d, video, defaults=QWEN2_VL, **overrides))


def qwen3_vl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> QwenVLProcessor:
    """Qwen3-VL: Qwen2VLImageProcessor with patch 16 and mean/std 0.5; Qwen3VLVideoProcessor."""
    return QwenVLProcessor(QwenVLProcessorConfig.from_hf(d, video, defaults=QWEN3_VL, **overrides))


def glm4v_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                  **overrides) -> QwenVLProcessor:
    """GLM-4.1V: Glm4vImageProcessor / Glm4vVideoProcessor."""
    return QwenVLProcessor(QwenVLProcessorConfig.from_hf(d, video, defaults=GLM4V, **overrides))
