"""Idefics3 / SmolVLM processor: transformers' Idefics3ImageProcessor (= SmolVLMImageProcessor) and its Pil
twin, as mmenc's packed patches.

Per image of H x W pixels, longest edge L (size), tile side M (max_image_size), in transformers' order:
  * resize so the longest side is L, the other scaled and rounded up to an even size (at most 4096);
  * with do_image_splitting: resize to multiples of M (the longer side first, the other from the aspect
    ratio), cut into M x M tiles in raster order, then the whole (resized) image resized to M x M goes last;
    without: resize to M x M. A resized image of exactly M x M is one tile;
  * rescale, normalize (mean/std 0.5).
Resampling: LANCZOS with backend="pil" (the Pil class); transformers' torchvision class falls back to
bicubic (antialiased) below torchvision 0.27 and on CUDA, which backend="torchvision" reproduces.
mmenc layout: an image's grid_thw row is (tiles, M/p, M/p); pixel_values rows are the tiles' (C, p, p)
patches, tile by tile, each in raster order (a partial last patch dropped, as the convolution does).
"""
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import (PatchProcessor, check_positive_ints, hf_keys, hf_resample, hf_rescale_normalize,
                                   patchify_tiles, resize_exact)
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess.images import size_text

MAX_IMAGE_SIZE = 4096  # transformers' absolute bound on a side after the first resize


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """The first resize: the longest side to `longest`, the other from the aspect ratio, made even; then
    scaled below 4096 (transformers' two helpers, their int() truncations included)."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def tile_multiple_size(height: int, width: int, tile: int) -> tuple[int, int]:
    """resize_for_vision_encoder: both sides to multiples of `tile`, the longer one first."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


@dataclasses.dataclass(frozen=True)
class Idefics3ProcessorConfig:
    """Defaults: transformers' Idefics3ImageProcessor (L = 4 x 364, M = 364, LANCZOS, mean/std 0.5)."""

    patch_size: int = 14
    longest_edge: int = 4 * 364
    tile: int = 364
    split: bool = True
    resample: str = "lanczos"
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "longest_edge", "tile"), prefix="Idefics3ProcessorConfig.")
        if self.resample not in ("lanczos", "bilinear", "bicubic"):
            raise ValueError(f"Idefics3ProcessorConfig.resample={self.resample!r}; expected 'lanczos', 'bilinear' or "
                             f"'bicubic' (PIL codes 1, 2, 3)")
        if self.tile < self.patch_size:
            raise ValueError(f"Idefics3ProcessorConfig: max_image_size={self.tile} is smaller than the tower's "
                             f"patch_size={self.patch_size}")
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, **overrides) -> "Idefics3ProcessorConfig":
        d, kw = dict(d or {}), {}
        if (d.get("size") or {}).get("longest_edge") is not None:
            kw["longest_edge"] = int(d["size"]["longest_edge"])
        elif d.get("size"):
            raise ValueError(f"size={d['size']}: mmenc's Idefics3 processor takes size={{'longest_edge': N}}")
        if (d.get("max_image_size") or {}).get("longest_edge") is not None:
            kw["tile"] = int(d["max_image_size"]["longest_edge"])
        if d.get("do_image_splitting") is not None:
            kw["split"] = bool(d["do_image_splitting"])
        kw.update(hf_resample(d, ("lanczos", "bilinear", "bicubic")))
        kw.update(hf_keys(d, ("patch_size", "do_resize", "do_rescale", "do_normalize")))
        kw.update(hf_rescale_normalize(d))
        return cls(**{**kw, **overrides})


class Idefics3Processor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] = (tiles, M/p, M/p))."""

    config_class = Idefics3ProcessorConfig

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        if height < 1 or width < 1:
            raise ImagePreprocessError(f"size {size_text(width, height)} is empty", index=index, name=name)
        c = self.config
        h, w = longest_edge_size(height, width, c.longest_edge) if c.do_resize else (height, width)
        canvas = tile_multiple_size(h, w, c.tile) if c.split else (c.tile, c.tile)
        tiles = (canvas[0] // c.tile) * (canvas[1] // c.tile)
        tiles += tiles > 1  # the global image after the tiles
        side = c.tile // c.patch_size
        return ImagePlan(size=(height, width), resize=(h, w), padded=canvas, grid=(tiles, side, side),
                         rows=tiles * side * side)

    def _resize(self, image: torch.Tensor, height: int, width: int) -> torch.Tensor:
        c = self.config
        if tuple(image.shape[-2:]) == (height, width):
            return image
        resample = "bicubic" if c.resample == "lanczos" and c.backend != "pil" else c.resample
        if resample == "bicubic":
            return resize_exact(image, height, width, c.backend)
        return ops.resize_uint8(image[None], height, width, c.backend, resample=resample)[0]

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [tiles, C, M, M]: the tiles in raster order, then the global image."""
        m = self.config.tile
        image = self._resize(image, *plan.resize)
        image = self._resize(image, *plan.padded)  # multiples of M (or M x M without splitting)
        c, h, w = image.shape
        if plan.grid[0] == 1:
            return image[None]
        tiles = image.view(c, h // m, m, w // m, m).permute(1, 3, 0, 2, 4).reshape(-1, c, m, m)
        return torch.cat([tiles, self._resize(image, m, m)[None]])

    def patchify(self, tiles: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [tiles, C, M, M] -> uint8 [tiles * s * s, C, p, p], each tile's patches in raster order."""
        edge = plan.grid[1] * self.config.patch_size
        return patchify_tiles(tiles[:, :, :edge, :edge], self.config.patch_size)


def idefics3_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> Idefics3Processor:
    """Idefics3's / SmolVLM's image processor from a preprocessor_config.json dict ({}: transformers' defaults)."""
    return Idefics3Processor(Idefics3ProcessorConfig.from_hf(d, **overrides))
