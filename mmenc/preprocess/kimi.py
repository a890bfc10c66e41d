"""Kimi-K2.5 (MoonViT) processor: transformers' Kimi_K25ImageProcessor / Kimi_K25VideoProcessor.

Differs from the Qwen family, hence its own file:
  * `navit_resize`: never upscales; shrinks to fit max_patches (total) and max_size_per_side patches
    per side, then zero-pads bottom/right (in uint8, before normalization: padded pixels become
    (0 - mean) / std) to multiples of patch_size * merge_size;
  * no temporal duplication: pixel_values are [P, C, p, p] (transformers' layout, not flattened);
    grid_thw counts unmerged patches [t, h/p, w/p];
  * video: frames are cut into chunks of temporal_patch_size (4) frames; each chunk is one grid
    row [frames_in_chunk, gh, gw] (the last chunk may be shorter, it is not padded).
transformers only has a torchvision backend here, so backend="torchvision" is the match.
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, resize_exact
from mmenc.preprocess.images import load_image, process_by_size, size_text
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError


def navit_resize(height: int, width: int, patch_size: int, merge_size: int, max_patches: int,
                 max_size_per_side: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """-> ((resized_h, resized_w), (padded_h, padded_w)) for one image."""
    n_h, n_w = max(1.0, height // patch_size), max(1.0, width // patch_size)
    scale = min(1.0, math.sqrt(max_patches / (n_h * n_w)),
                max_size_per_side * patch_size / height, max_size_per_side * patch_size / width)
    side = max_size_per_side * patch_size
    h = min(max(1, int(height * scale)), side)
    w = min(max(1, int(width * scale)), side)
    f = patch_size * merge_size
    return (h, w), (h + (f - h % f) % f, w + (f - w % f) % f)


@dataclasses.dataclass(frozen=True)
class KimiProcessorConfig:
    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 4  # video chunk length
    max_patches: int = 16384
    video_max_patches: int = 4096
    max_size_per_side: int = 512  # in patches; transformers' size={"max_height": n, "max_width": n}
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "merge_size", "temporal_patch_size", "max_patches",
                                   "video_max_patches", "max_size_per_side"))
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                **overrides) -> "KimiProcessorConfig":
        """From preprocessor_config.json (and video_preprocessor_config.json) dicts."""
        d, video, kw = dict(d or {}), dict(video or {}), {}
        for k in ("patch_size", "merge_size", "max_patches", "do_resize", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = d[k]
        if d.get("rescale_factor") is not None:
            kw["rescale_factor"] = float(d["rescale_factor"])
        size = d.get("size") or {}
        if size.get("max_height") is not None:
            if size.get("max_width") not in (None, size["max_height"]):
                raise ValueError(f"size={size}: max_height and max_width must be equal")
            kw["max_size_per_side"] = int(size["max_height"])
        for k in ("image_mean", "image_std"):
            if d.get(k) is not None:
                kw[k] = tuple(float(x) for x in d[k])
        if video.get("max_patches") is not None:
            kw["video_max_patches"] = int(video["max_patches"])
        if video.get("temporal_patch_size") is not None:
            kw["temporal_patch_size"] = int(video["temporal_patch_size"])
        kw.update(overrides)
        return cls(**kw)


class KimiProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] = [1, h/p, w/p]).

    Per image (pipeline): plan, resize_one here; patchify (raster), normalize, finish: PatchProcessor's."""

    config_class = KimiProcessorConfig

    def _process(self, x: torch.Tensor, max_patches: int) -> tuple[torch.Tensor, int, int]:
        """uint8 [B, C, H, W] (same size) -> float32 [B, gh*gw, C, p, p], gh, gw."""
        c = self.config
        if c.do_resize:
            (h, w), (ph, pw) = navit_resize(x.shape[-2], x.shape[-1], c.patch_size, c.merge_size, max_patches,
                                            c.max_size_per_side)
            x = ops.resize_uint8(x, h, w, c.backend)
            x = F.pad(x, (0, pw - w, 0, ph - h))  # zeros, bottom/right
        return self._patchify(x)

    def _patchify(self, x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        """uint8 [B, C, H, W] (padded) -> float32 [B, gh*gw, C, p, p], gh, gw."""
        c, p = self.config, self.config.patch_size
        x = ops.rescale_normalize(x, rescale_factor=c.rescale_factor, mean=c.image_mean, std=c.image_std,
                                  do_rescale=c.do_rescale, do_normalize=c.do_normalize, backend=c.backend)
        b, ch, h, w = x.shape
        if h % p or w % p:
            raise ValueError(f"size {size_text(w, h)} is not a multiple of patch_size={p}; keep do_resize=True")
        gh, gw = h // p, w // p
        x = x.view(b, ch, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)  # b, gh, gw, C, p, p
        return x.reshape(b, gh * gw, ch, p, p), gh, gw

    # -- per image: plan (size only) -> resize_one (a worker thread or the GPU) -> finish (device) --
    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        """What preprocessing does to one image of height x width, or ImagePreprocessError naming it."""
        c, p = self.config, self.config.patch_size
        if c.do_resize:
            (h, w), (ph, pw) = navit_resize(height, width, p, c.merge_size, c.max_patches, c.max_size_per_side)
        else:
            (h, w), (ph, pw) = (height, width), (height, width)
            if h % p or w % p:
                raise ImagePreprocessError(f"size {size_text(w, h)} is not a multiple of patch_size={p}; keep "
                                           f"do_resize=True", index=index, name=name)
        return ImagePlan(size=(height, width), resize=(h, w), padded=(ph, pw), grid=(1, ph // p, pw // p),
                         rows=(ph // p) * (pw // p))

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, *plan.padded] (resized, then zero-padded bottom/right); off
        the CPU the resize is `resize_uint8_exact` (the CPU kernel's bytes)."""
        if not self.config.do_resize:
            return image
        (h, w), (ph, pw) = plan.resize, plan.padded
        x = resize_exact(image, h, w, self.config.backend)
        return F.pad(x, (0, pw - w, 0, ph - h))

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        def process(arrays):
            patches, gh, gw = self._process(ops.stack_hwc(arrays, self.device), self.config.max_patches)
            return patches, (1, gh, gw)

        return process_by_size(images, process)

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """frames of one video -> (pixel_values [P, C, p, p], grid_thw [ceil(T/tp), 3]), one row per chunk.

        Every frame given is used (transformers with do_sample_frames=False; its default fps
        sampling needs metadata a plain frame list does not have).
        """
        if len(frames) == 0:
            raise ValueError("frames is empty; pass at least one frame")
        arrays = [load_image(f, index=i) for i, f in enumerate(frames)]
        shapes = {a.shape for a in arrays}
        if len(shapes) > 1:
            raise ValueError(f"video frames differ in size: {sorted(shapes)}; all frames must match")
        patches, gh, gw = self._process(ops.stack_hwc(arrays, self.device), self.config.video_max_patches)
        tp = self.config.temporal_patch_size
        grid = [[min(tp, len(arrays) - s), gh, gw] for s in range(0, len(arrays), tp)]
        return patches.flatten(0, 1), torch.tensor(grid, dtype=torch.int64)


def kimi_k25_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> KimiProcessor:
    """Kimi-K2.5 processor from preprocessor_config.json dicts ({} for transformers' defaults)."""
    return KimiProcessor(KimiProcessorConfig.from_hf(d, video, **overrides))
