"""Ovis2 processor: transformers' Ovis2ImageProcessor (torchvision) / Ovis2ImageProcessorPil.

Crops, per image of H x W pixels, crop side T, with crop_to_patches and max_patches > 1:
  * choose (cols, rows): with use_covering_area_grid, the fewest crops whose cells cover more than
    90% of the image (each cell counted at most T on its long side), best coverage as tie-break, else
    the best coverage; without it, the (cols, rows) whose aspect ratio is closest to the image's
    (min_patches..max_patches crops; a later equal one wins when the image area exceeds half the canvas);
  * bicubic resize to (rows * T, cols * T), cut into crops in raster order, and when there is more
    than one, a thumbnail (the whole image resized to T x T) goes first.
Without cropping, the image is resized to T x T. Then rescale and normalize (CLIP mean/std).

mmenc layout: an image's grid_thw row is (crops, T/p, T/p); its pixel_values rows are the crops'
patches, crop by crop, each crop's patches in raster order, one row (C, p, p) per patch.
"""
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, hf_rescale_normalize, patchify_tiles
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess.qwen_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from mmenc.preprocess.images import size_text


@functools.lru_cache(maxsize=16)
def crop_layouts(min_crops: int, max_crops: int) -> tuple[tuple[int, int], ...]:
    """(a, b) pairs with min_crops <= a * b <= max_crops, by crop count (a outer, b inner within a count)."""
    pairs = [(a, b) for a in range(1, max_crops + 1) for b in range(1, max_crops + 1) if min_crops <= a * b <= max_crops]
    return tuple(sorted(pairs, key=lambda ab: ab[0] * ab[1]))


def _cell_area(width: int, height: int, side: int) -> float:
    long, short = max(width, height), min(width, height)
    return long * short if long <= side else short / long * side * side


def covering_layout(height: int, width: int, side: int, max_crops: int, threshold: float = 0.9) -> tuple[int, int]:
    """(cols, rows) by covered area (see the module docstring); a layout (a, b) is scored on a grid of
    a rows and b columns of the image, as transformers does, and returned as (cols, rows) = (a, b)."""
    scored = []
    for a, b in crop_layouts(1, max_crops):
        row_h, col_w = height // a, width // b
        covered = 0.0
        for r in range(a):
            for c in range(b):
                w = (width if c == b - 1 else (c + 1) * col_w) - c * col_w
                h = (height if r == a - 1 else (r + 1) * row_h) - r * row_h
                covered += _cell_area(w, h, side)
        scored.append(((a, b), covered / (width * height)))
    enough = [s for s in scored if s[1] > threshold]
    if enough:
        return min(enough, key=lambda s: (s[0][0] * s[0][1], -s[1]))[0]
    return min(scored, key=lambda s: (-s[1], s[0][0] * s[0][1]))[0]


def aspect_layout(height: int, width: int, side: int, min_crops: int, max_crops: int) -> tuple[int, int]:
    """(cols, rows) whose aspect ratio cols / rows is closest to width / height."""
    ratio, best, best_diff = width / height, (1, 1), float("inf")
    for cols, rows in crop_layouts(min_crops, max_crops):
        diff = abs(ratio - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * side * side * cols * rows:
            best = (cols, rows)
    return best


@dataclasses.dataclass(frozen=True)
class Ovis2ProcessorConfig:
    """Defaults: 448 px crops (the published Ovis2 towers' image_size) with cropping on; transformers'
    class defaults (384 px, no cropping) do not fit those towers. A preprocessor_config.json overrides."""

    crop_size: int = 448
    patch_size: int = 14
    crop_to_patches: bool = True
    min_patches: int = 1
    max_patches: int = 12
    use_covering_area_grid: bool = True
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("crop_size", "patch_size", "min_patches", "max_patches"))
        if self.crop_size % self.patch_size:
            raise ValueError(f"crop_size={self.crop_size} must be a multiple of patch_size={self.patch_size}")
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, **overrides) -> "Ovis2ProcessorConfig":
        d, kw = dict(d or {}), {}
        size = d.get("size") or {}
        if size.get("height") is not None:
            if size.get("width") not in (None, size["height"]):
                raise ValueError(f"size={size}: Ovis2 crops are square; height and width must be equal")
            kw["crop_size"] = int(size["height"])
        if d.get("do_resize") is False:
            raise ValueError("do_resize=False: the Ovis2 tower needs crop_size x crop_size crops; remove it")
        for k in ("patch_size", "crop_to_patches", "min_patches", "max_patches", "use_covering_area_grid",
                  "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = d[k]
        kw.update(hf_rescale_normalize(d))
        kw.update(overrides)
        return cls(**kw)


class Ovis2Processor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] of (crops, T/p, T/p))."""

    config_class = Ovis2ProcessorConfig

    def layout(self, height: int, width: int) -> tuple[int, int]:
        """(cols, rows) of crops for an image (1, 1 without cropping)."""
        c = self.config
        if not (c.crop_to_patches and c.max_patches > 1):
            return 1, 1
        if c.use_covering_area_grid:
            return covering_layout(height, width, c.crop_size, c.max_patches)
        return aspect_layout(height, width, c.crop_size, c.min_patches, c.max_patches)

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        if height < 1 or width < 1:
            raise ImagePreprocessError(f"size {size_text(width, height)} is empty", index=index, name=name)
        t = self.config.crop_size
        cols, rows = self.layout(height, width)
        crops = cols * rows + (cols * rows > 1)  # + the thumbnail
        side = t // self.config.patch_size
        return ImagePlan(size=(height, width), resize=(rows * t, cols * t), padded=(rows * t, cols * t),
                         grid=(crops, side, side), rows=crops * side * side)

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [crops, C, T, T]: the thumbnail (when several crops), then the crops."""
        t, backend = self.config.crop_size, self.config.backend
        (h, w) = plan.resize
        x = ops.resize_uint8(image[None], h, w, backend)[0]
        c = x.shape[0]
        crops = x.view(c, h // t, t, w // t, t).permute(1, 3, 0, 2, 4).reshape(-1, c, t, t)
        if crops.shape[0] > 1:
            crops = torch.cat([ops.resize_uint8(image[None], t, t, backend), crops])
        return crops

    def patchify(self, crops: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [crops, C, T, T] -> uint8 [crops * s * s, C, p, p], each crop's patches in raster order."""
        return patchify_tiles(crops, self.config.patch_size)


def ovis2_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                  **overrides) -> Ovis2Processor:
    """Ovis2 processor from a preprocessor_config.json dict ({} for mmenc's preset, see Ovis2ProcessorConfig)."""
    return Ovis2Processor(Ovis2ProcessorConfig.from_hf(d, **overrides))
