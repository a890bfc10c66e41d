"""LLaVA-NeXT and LLaVA-OneVision processors: transformers' LlavaNextImageProcessor /
LlavaOnevisionImageProcessor (and their *Pil twins for backend="pil"), as mmenc's packed patches.

Per image of H x W pixels, tile side T (crop_size, else size), in transformers' order (uint8 throughout):
  * the canvas: the image_grid_pinpoints entry that keeps most pixels (mmenc.anyres.select_best_resolution);
    the image resized into it (bicubic, aspect kept: mmenc.anyres.patch_output_size), zero-padded around
    it ((canvas - size) // 2 before it), cut into T x T tiles in raster order;
  * the base tile: the whole image resized to `size` (its shortest edge squared, or height x width);
  * every tile (base first) then goes through resize to `size` and, with do_center_crop, the crop (both
    no-ops for the published configs), rescale and normalize.
mmenc layout: the grid_thw row of an image is (tiles, s, s, H, W) with s = T / patch and (H, W) the image
size (transformers' image_sizes), so the tower can unpad; pixel_values rows are the tiles' (C, p, p)
patches, tile by tile, each tile's patches in raster order.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from mmenc.anyres import patch_output_size, select_best_resolution
from mmenc.preprocess.base import PatchProcessor, patchify_tiles, resize_exact
from mmenc.preprocess.clip import ClipProcessorConfig, center_crop, resized_size
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess import ops
from mmenc.preprocess.images import size_text

# transformers' class defaults (LlavaNextImageProcessor, LlavaOnevisionImageProcessor)
NEXT_PINPOINTS = ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))
ONEVISION_PINPOINTS = tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))


@dataclasses.dataclass(frozen=True)
class AnyresProcessorConfig:
    """The CLIP-style steps applied to every tile (`tile`), the canvases, and the tile side."""

    tile: ClipProcessorConfig
    pinpoints: tuple[tuple[int, int], ...] = NEXT_PINPOINTS

    def __post_init__(self):
        if not self.pinpoints or any(len(p) != 2 or min(p) <= 0 for p in self.pinpoints):
            raise ValueError(f"image_grid_pinpoints={[list(p) for p in self.pinpoints]}; expected [[height, width], "
                             f"...] of positive sizes")
        side = self.side
        if any(h % side or w % side for h, w in self.pinpoints):
            raise ValueError(f"image_grid_pinpoints={[list(p) for p in self.pinpoints]} are not multiples of the tile "
                             f"side {side} (crop_size / size); every canvas must cut into whole tiles")

    @property
    def side(self) -> int:
        """T: crop_size's height with a crop, else size's (height or shortest edge)."""
        t = self.tile
        if t.crop:
            return t.crop_height
        return t.height if not t.shortest_edge else t.shortest_edge

    @property
    def base_size(self) -> tuple[int, int]:
        t = self.tile
        return (t.height, t.width) if not t.shortest_edge else (t.shortest_edge, t.shortest_edge)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, onevision: bool, **overrides) -> "AnyresProcessorConfig":
        """From a preprocessor_config.json dict; onevision: LlavaOnevisionImageProcessor's defaults (384 px
        tiles without a crop, 6 x 6 canvases) under what the dict sets, else LlavaNextImageProcessor's."""
        d = dict(d or {})
        defaults = ({"size": {"height": 384, "width": 384}, "do_center_crop": False} if onevision else
                    {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}})
        given = {k: v for k, v in d.items() if v is not None and k != "do_pad"}  # do_pad: batch padding only
        tile = ClipProcessorConfig.from_hf({**defaults, **given}, **overrides)
        pinpoints = d.get("image_grid_pinpoints") or (ONEVISION_PINPOINTS if onevision else NEXT_PINPOINTS)
        return cls(tile=tile, pinpoints=tuple((int(h), int(w)) for h, w in pinpoints))


class AnyresProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 5] = (tiles, s, s, H, W));
    see the module docstring. normalize / row_shape read the tile config."""

    def __init__(self, config: AnyresProcessorConfig):
        super().__init__(config.tile)
        self.anyres = config

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        if height < 1 or width < 1:
            raise ImagePreprocessError(f"size {size_text(width, height)} is empty", index=index, name=name)
        a, p = self.anyres, self.config.patch_size
        canvas = select_best_resolution(height, width, a.pinpoints)
        tiles = 1 + (canvas[0] // a.side) * (canvas[1] // a.side)
        final = self.tile_size(a.side, a.side)
        if final != self.tile_size(*a.base_size) or final[0] != final[1] or final[0] < p:
            base = self.tile_size(*a.base_size)
            raise ImagePreprocessError(f"tiles come out {size_text(final[1], final[0])} (base {size_text(base[1], base[0])}); "
                                       f"the tower needs square tiles of at least its {p} px patch: check size / "
                                       f"crop_size", index=index, name=name)
        s = final[0] // p
        return ImagePlan(size=(height, width), resize=patch_output_size(height, width, canvas), padded=canvas,
                         grid=(tiles, s, s, height, width), rows=tiles * s * s)

    def tile_size(self, height: int, width: int) -> tuple[int, int]:
        """A tile's size after the per-tile resize and crop."""
        c = self.config
        h, w = resized_size(height, width, c)
        return (c.crop_height, c.crop_width) if c.crop else (h, w)

    def _resize(self, image: torch.Tensor, height: int, width: int) -> torch.Tensor:
        c = self.config
        if tuple(image.shape[-2:]) == (height, width):
            return image
        if c.resample == "bicubic":
            return resize_exact(image, height, width, c.backend)
        return ops.resize_uint8(image[None], height, width, c.backend, resample=c.resample)[0]

    def _finish_tile(self, tile: torch.Tensor) -> torch.Tensor:
        """The per-tile resize (to `size`) and centre crop."""
        c = self.config
        tile = self._resize(tile, *resized_size(tile.shape[-2], tile.shape[-1], c)) if c.do_resize else tile
        return center_crop(tile, c.crop_height, c.crop_width, c.backend) if c.crop else tile

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [tiles, C, t, t]: the base tile, then the canvas's tiles in raster order."""
        (rh, rw), (ch, cw), side = plan.resize, plan.padded, self.anyres.side
        resized = self._resize(image, rh, rw)
        canvas = resized.new_zeros(image.shape[0], ch, cw)
        top, left = (ch - rh) // 2, (cw - rw) // 2
        canvas[:, top:top + rh, left:left + rw] = resized
        c = image.shape[0]
        tiles = canvas.view(c, ch // side, side, cw // side, side).permute(1, 3, 0, 2, 4).reshape(-1, c, side, side)
        base = self._resize(image, *self.anyres.base_size)
        return torch.stack([self._finish_tile(t) for t in (base, *tiles)])

    def patchify(self, tiles: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [tiles, C, t, t] -> uint8 [tiles * s * s, C, p, p], each tile's patches in raster order (the
        convolution drops a partial last patch: SigLIP/14 at 384 px has 27 x 27)."""
        edge = plan.grid[1] * self.config.patch_size
        return patchify_tiles(tiles[:, :, :edge, :edge], self.config.patch_size)


def llava_next_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                       **overrides) -> AnyresProcessor:
    """LLaVA-NeXT's processor (LlavaNextImageProcessor)."""
    return AnyresProcessor(AnyresProcessorConfig.from_hf(d, onevision=False, **overrides))


def llava_onevision_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                            **overrides) -> AnyresProcessor:
    """LLaVA-OneVision's processor (LlavaOnevisionImageProcessor), single images (each tiled)."""
    return AnyresProcessor(AnyresProcessorConfig.from_hf(d, onevision=True, **overrides))
