"""InternVL processor: transformers' GotOcr2ImageProcessor (and ...Pil) as InternVLProcessor calls it
(crop_to_patches=True): dynamic tiling with a thumbnail tile.

Per image: choose the tile grid (columns x rows, min_patches <= tiles <= max_patches) whose aspect
ratio is closest to the image's (ties: the larger grid while the image covers more than half of
its area), resize the image to that canvas and cut it into size x size tiles (row-major), then add
the whole image resized to one tile (the thumbnail) when there is more than one tile.
Output: pixel_values float32 [P, C, p, p] (tile after tile, each tile's patches in raster order),
grid_thw int64 [N, 3] = [tiles, size/p, size/p], one row per image.
"""
import dataclasses
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, hf_rescale_normalize
from mmenc.preprocess.images import process_by_size
from mmenc.preprocess.plan import ImagePlan
from mmenc.preprocess.resize_exact import resize_uint8_exact

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@functools.lru_cache(maxsize=256)
def tile_grid(height: int, width: int, tile: int, min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(columns, rows) of the tile canvas for an image of height x width (transformers'
    get_optimal_tiled_canvas)."""
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for c, r in grids:
        diff = abs(aspect - c / r)
        if diff < best_diff:
            best, best_diff = (c, r), diff
        elif diff == best_diff and area > 0.5 * tile * tile * c * r:
            best = (c, r)
    return best


@dataclasses.dataclass(frozen=True)
class InternVLProcessorConfig:
    tile_size: int = 448
    patch_size: int = 14
    crop_to_patches: bool = True
    min_patches: int = 1
    max_patches: int = 12
    image_mean: tuple[float, ...] = IMAGENET_MEAN
    image_std: tuple[float, ...] = IMAGENET_STD
    rescale_factor: float = 1 / 255
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("tile_size", "patch_size", "min_patches", "max_patches"),
                            prefix="InternVLProcessorConfig.")
        if self.tile_size % self.patch_size:
            raise ValueError(f"InternVLProcessorConfig: tile_size={self.tile_size} is not a multiple of "
                             f"patch_size={self.patch_size}")
        if self.min_patches > self.max_patches:
            raise ValueError(f"InternVLProcessorConfig: min_patches={self.min_patches} > max_patches="
                             f"{self.max_patches}")
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, **overrides) -> "InternVLProcessorConfig":
        """From a preprocessor_config.json dict; {} gives InternVL's published values (448 px tiles,
        ImageNet mean/std, 1..12 tiles, cropping on as InternVLProcessor passes it)."""
        d, kw = dict(d or {}), {}
        size = d.get("size") or {}
        if size.get("height") is not None:
            if size.get("width") not in (None, size["height"]):
                raise ValueError(f"size={size}: height and width must be equal (square tiles)")
            kw["tile_size"] = int(size["height"])
        for k in ("min_patches", "max_patches", "patch_size"):  # patch_size: the tower's (processor_defaults)
            if d.get(k) is not None:
                kw[k] = int(d[k])
        for k in ("do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = bool(d[k])
        kw.update(hf_rescale_normalize(d))
        kw.update(overrides)
        return cls(**kw)


class InternVLProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] = [tiles, s/p, s/p]).

    patchify (raster order over the tiles stacked top to bottom: tile by tile), normalize and finish
    are PatchProcessor's."""

    config_class = InternVLProcessorConfig

    def canvas(self, height: int, width: int) -> tuple[int, int]:
        """(columns, rows) of tiles for an image of height x width."""
        c = self.config
        if not c.crop_to_patches or c.max_patches <= 1:
            return 1, 1
        return tile_grid(height, width, c.tile_size, c.min_patches, c.max_patches)

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        """resize: the canvas (rows * s, cols * s); grid: (tiles incl. the thumbnail, s/p, s/p)."""
        s, p = self.config.tile_size, self.config.patch_size
        cols, rows = self.canvas(height, width)
        tiles = cols * rows + (1 if cols * rows > 1 else 0)
        return ImagePlan(size=(height, width), resize=(rows * s, cols * s), padded=(rows * s, cols * s),
                         grid=(tiles, s // p, s // p), rows=tiles * (s // p) ** 2)

    def _resize(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """uint8 [B, C, H, W] -> [B, C, h, w]; off the CPU `resize_uint8_exact` (the CPU kernel's bytes)."""
        if tuple(x.shape[-2:]) == (h, w):
            return x
        if x.device.type != "cpu" and self.config.backend == "torchvision":
            return torch.stack([resize_uint8_exact(im, h, w) for im in x])
        return ops.resize_uint8(x, h, w, self.config.backend)

    def _tiles(self, x: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [B, C, H, W] (one input size) -> uint8 [B, C, tiles * s, s]: tiles stacked top to bottom."""
        s = self.config.tile_size
        rows, cols = plan.resize[0] // s, plan.resize[1] // s
        canvas = self._resize(x, *plan.resize)
        parts = [canvas[..., r * s:(r + 1) * s, c * s:(c + 1) * s] for r in range(rows) for c in range(cols)]
        if len(parts) > 1:
            parts.append(self._resize(x, s, s))  # the thumbnail: the whole image as one tile
        return torch.cat(parts, dim=-2)

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, tiles * s, s] (the image's tiles, top to bottom)."""
        return self._tiles(image[None], plan)[0]

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        def process(arrays):
            x = ops.stack_hwc(arrays, self.device)  # uint8 [B, C, H, W], one size
            plan = self.plan(x.shape[-2], x.shape[-1])
            patches = torch.stack([self.patchify(im, plan) for im in self._tiles(x, plan)])
            return self.normalize(patches), plan.grid

        return process_by_size(images, process)

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("mmenc's InternVL processor takes images only; pass video frames as images")


def internvl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> InternVLProcessor:
    """InternVL processor from a preprocessor_config.json dict ({}: InternVL's published values)."""
    return InternVLProcessor(InternVLProcessorConfig.from_hf(d, **overrides))
