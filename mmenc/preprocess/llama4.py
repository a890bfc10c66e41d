"""Llama 4 processor: transformers' Llama4ImageProcessor (its torchvision class; there is no PIL one).

Tiling, per image of H x W pixels, tile side T (336), at most max_patches (16) tiles:
  * canvases: every (rows, cols) of tiles with rows * cols <= max_patches, in transformers' order;
  * best canvas: the smallest upscale >= 1 that fits the image without distortion (the largest with
    resize_to_max_canvas), else the mildest downscale; ties go to the smallest area, then the first;
  * resize (bilinear, antialiased, aspect kept) to fit the canvas, never upscaling past T on a side
    unless resize_to_max_canvas; zero-pad bottom/right to the canvas (in uint8, before normalizing);
  * cut into rows * cols tiles in raster order, and when there is more than one, append a global
    tile: the whole image resized to T x T.
Rescale and normalize run in bfloat16, as transformers does; pixel_values come back as float32 with
those bf16 values.

mmenc layout: an image's grid_thw row is (tiles, T/p, T/p); its pixel_values rows are the tiles'
patches, tile by tile, each tile's patches in raster order, one row (C, p, p) per patch (what
mmenc.models.llama4 reads).
"""
import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from mmenc.preprocess.base import PatchProcessor, check_positive_ints, hf_rescale_normalize, patchify_tiles
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess.images import size_text


@functools.lru_cache(maxsize=8)
def tile_canvases(max_tiles: int) -> tuple[tuple[int, int], ...]:
    """(rows, cols) of tiles with rows * cols <= max_tiles, grouped by aspect ratio in order of first
    appearance (tile counts from max_tiles down, factor pairs by ascending rows): transformers' order,
    which decides ties."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(r for r in range(1, count + 1) if count % r == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return tuple(c for group in by_ratio.values() for c in group)


def best_canvas(height: int, width: int, tile: int, max_tiles: int, to_max: bool) -> tuple[int, int]:
    """The canvas (pixels) an image is fitted into; float32 scales as transformers computes them."""
    canvases = torch.tensor(tile_canvases(max_tiles)) * tile  # [K, 2] (h, w)
    scales = torch.minimum(canvases[:, 0] / height, canvases[:, 1] / width)  # float32
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    fits = canvases[scales == chosen]
    best = fits[torch.argmin(fits[:, 0] * fits[:, 1])]
    return int(best[0]), int(best[1])


def fit_size(height: int, width: int, canvas: tuple[int, int], tile: int, to_max: bool) -> tuple[int, int]:
    """(h, w) after the aspect-preserving resize into `canvas` (capped at max(side, tile) per side
    unless to_max); float32 arithmetic where transformers' operands are tensors."""
    ch, cw = canvas
    if not to_max:
        ch, cw = min(max(height, tile), ch), min(max(width, tile), cw)
    # transformers keeps the canvas side as a 0-d int64 tensor when it is the smaller: float32 division
    th = torch.tensor(ch) if ch < max(height, tile) or to_max else ch
    tw = torch.tensor(cw) if cw < max(width, tile) or to_max else cw
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        h, w = min(math.floor(height * scale_w), th), tw
    else:
        h, w = th, min(math.floor(width * scale_h), tw)
    return max(int(h), 1), max(int(w), 1)


def resize_bilinear(x: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [B, C, H, W] -> uint8 [B, C, height, width]: antialiased bilinear as torchvision does it
    (uint8 kernel on the CPU; float32, rounded, elsewhere)."""
    if tuple(x.shape[-2:]) == (height, width):
        return x
    if x.device.type == "cpu":
        return F.interpolate(x, size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    out = F.interpolate(x.float(), size=(height, width), mode="bilinear", align_corners=False, antialias=True)
    return out.round_().to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class Llama4ProcessorConfig:
    tile_size: int = 336
    patch_size: int = 14
    max_patches: int = 16  # tiles per image (transformers' name)
    resize_to_max_canvas: bool = False
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True

    def __post_init__(self):
        check_positive_ints(self, ("tile_size", "patch_size", "max_patches"))
        if self.tile_size % self.patch_size:
            raise ValueError(f"tile_size={self.tile_size} must be a multiple of patch_size={self.patch_size}")

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, **overrides) -> "Llama4ProcessorConfig":
        """From preprocessor_config.json (size {"height", "width"}, max_patches, resize_to_max_canvas, ...)."""
        d, kw = dict(d or {}), {}
        size = d.get("size") or {}
        if size.get("height") is not None:
            if size.get("width") not in (None, size["height"]):
                raise ValueError(f"size={size}: Llama 4 tiles are square; height and width must be equal")
            kw["tile_size"] = int(size["height"])
        if d.get("do_resize") is False:
            raise ValueError("do_resize=False: Llama 4 always fits images to its tile canvases; remove it")
        for k in ("patch_size", "max_patches", "resize_to_max_canvas", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = d[k]
        kw.update(hf_rescale_normalize(d))
        kw.update(overrides)
        return cls(**kw)


class Llama4Processor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] of (tiles, T/p, T/p))."""

    config_class = Llama4ProcessorConfig

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        c = self.config
        if height < 1 or width < 1:
            raise ImagePreprocessError(f"size {size_text(width, height)} is empty", index=index, name=name)
        canvas = best_canvas(height, width, c.tile_size, c.max_patches, c.resize_to_max_canvas)
        resized = fit_size(height, width, canvas, c.tile_size, c.resize_to_max_canvas)
        tiles = (canvas[0] // c.tile_size) * (canvas[1] // c.tile_size)
        tiles += tiles > 1  # the global tile
        side = c.tile_size // c.patch_size
        return ImagePlan(size=(height, width), resize=resized, padded=canvas, grid=(tiles, side, side),
                         rows=tiles * side * side)

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [tiles, C, T, T]: the canvas's tiles, then the global tile if any."""
        t = self.config.tile_size
        (h, w), (ch, cw) = plan.resize, plan.padded
        x = F.pad(resize_bilinear(image[None], h, w), (0, cw - w, 0, ch - h))[0]  # zeros, bottom/right
        c = x.shape[0]
        tiles = x.view(c, ch // t, t, cw // t, t).permute(1, 3, 0, 2, 4).reshape(-1, c, t, t)
        if tiles.shape[0] > 1:
            tiles = torch.cat([tiles, resize_bilinear(image[None], t, t)])
        return tiles

    def patchify(self, tiles: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [tiles, C, T, T] -> uint8 [tiles * s * s, C, p, p], each tile's patches in raster order."""
        return patchify_tiles(tiles, self.config.patch_size)

    def normalize(self, patches: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """uint8 [P, C, p, p] -> float32 [P, C, p, p]: rescale and normalize in bfloat16 (transformers')."""
        c = self.config
        x = patches.to(torch.bfloat16)
        if c.do_rescale:
            x = x * c.rescale_factor
        if c.do_normalize:
            mean = torch.tensor(c.image_mean, dtype=torch.bfloat16, device=x.device).view(-1, 1, 1)
            std = torch.tensor(c.image_std, dtype=torch.bfloat16, device=x.device).view(-1, 1, 1)
            x = (x - mean) / std
        if out is None:
            return x.float()
        return out.copy_(x)


def llama4_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                   **overrides) -> Llama4Processor:
    """Llama 4 processor from a preprocessor_config.json dict ({} for transformers' defaults); images only."""
    return Llama4Processor(Llama4ProcessorConfig.from_hf(d, **overrides))
