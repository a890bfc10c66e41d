"""Packing an anyres image's tile features the way LLaVA-NeXT / LLaVA-OneVision do (host side, per grid).

The tower gives each image's features tile by tile, tokens of a tile in raster order: the base tile,
then the canvas's tiles in raster order (s x s tokens each). The language model takes: the base tile's
tokens, then the canvas's feature rows (tiles stitched together), the padding cut off
(mmenc.anyres.unpadded_region), for OneVision bilinearly shrunk past max_tiles tiles
(mmenc.anyres.anyres_max_size; F.interpolate(mode="bilinear"), align_corners=False), and after each row
the learned newline vector. An image given as a single tile ((t, h, w) rows of three columns) is its
tokens and one newline (transformers' one-tile branch).

`pack_taps` turns that into taps over the table [features; newline]: index int64 [out, k] and weight
float32 [out, k] (k = 1 unless something is resampled: 2 x 2 bilinear taps), built once per grid.
"""
import dataclasses
from collections.abc import Sequence

import torch

from mmenc.anyres import anyres_max_size, select_best_resolution, unpadded_region
from mmenc.layers.pos_embed import axis_taps


@dataclasses.dataclass(frozen=True)
class AnyresGeometry:
    """side: tokens per tile side (s); tile_px: the tile in pixels (vision image_size); pinpoints: the canvases;
    max_tiles: OneVision's anyres_max_N (0: never shrink, LLaVA-NeXT)."""

    side: int
    tile_px: int
    pinpoints: tuple[tuple[int, int], ...]
    max_tiles: int = 0

    def canvas_tiles(self, height: int, width: int) -> tuple[int, int]:
        """(tile rows, tile columns) of the canvas chosen for an image of height x width pixels."""
        h, w = select_best_resolution(height, width, self.pinpoints)
        return h // self.tile_px, w // self.tile_px

    def image_taps(self, offset: int, height: int, width: int, newline: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One image whose tiles' features start at row `offset`: (index [out, k], weight [out, k]) float64."""
        s = self.side
        nh, nw = self.canvas_tiles(height, width)
        r, c = torch.arange(nh * s)[:, None], torch.arange(nw * s)[None, :]
        canvas = offset + s * s + ((r // s) * nw + c // s) * s * s + (r % s) * s + c % s  # [nh*s, nw*s] rows
        top, left, kept_rows, kept_cols = unpadded_region(height, width, nh * s, nw * s)
        kept = canvas[top:top + kept_rows, left:left + kept_cols]
        shrunk = anyres_max_size(kept_rows, kept_cols, s, self.max_tiles) if self.max_tiles else None
        if shrunk is None:
            index, weight = kept[..., None], torch.ones(*kept.shape, 1, dtype=torch.float64)  # [R, C, 1]
        else:
            rt, rw = axis_taps(shrunk[0], kept_rows, "bilinear")  # [R', 2]
            ct, cw = axis_taps(shrunk[1], kept_cols, "bilinear")  # [C', 2]
            index = kept[rt[:, None, :, None], ct[None, :, None, :]].flatten(2)  # [R', C', 4]
            weight = (rw[:, None, :, None] * cw[None, :, None, :]).flatten(2)
        rows, cols, k = index.shape
        index = torch.cat([index, torch.full((rows, 1, k), newline)], 1)  # a newline after each row
        weight = torch.cat([weight, torch.zeros(rows, 1, k, dtype=torch.float64)], 1)
        weight[:, -1, 0] = 1.0
        base = torch.arange(offset, offset + s * s)[:, None]
        return _stack([(base, torch.ones(s * s, 1, dtype=torch.float64)),
                       (index.reshape(-1, k), weight.reshape(-1, k))])


def _stack(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Taps of several pieces, each padded to the widest (index 0, weight 0), concatenated."""
    width = max(i.shape[1] for i, _ in parts)
    pad = [(torch.nn.functional.pad(i, (0, width - i.shape[1])), torch.nn.functional.pad(w, (0, width - w.shape[1])))
           for i, w in parts]
    return torch.cat([i for i, _ in pad]), torch.cat([w for _, w in pad])


def pack_taps(grid: Sequence[tuple[int, ...]], tokens_per_frame: Sequence[int], geometry: AnyresGeometry
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Taps into [features of the pack; newline] (newline = the row after the features) for every grid row:
    (t, s, s, H, W) an anyres image of t tiles, (t, h, w) t single-tile images (their tokens, then the
    newline). tokens_per_frame: the tower's tokens per tile of each row. Returns (index int64 [out, k],
    weight float32 [out, k]), or (index [out], None) when every tap is a plain copy."""
    newline = sum(t * n for (t, *_), n in zip(grid, tokens_per_frame))
    parts, offset = [], 0
    for row, tokens in zip(grid, tokens_per_frame):
        t = row[0]
        if len(row) == 5:
            parts.append(geometry.image_taps(offset, row[3], row[4], newline))
        else:
            for frame in range(t):
                rows = torch.arange(offset + frame * tokens, offset + (frame + 1) * tokens)
                index = torch.cat([rows, torch.tensor([newline])])[:, None]
                parts.append((index, torch.ones(tokens + 1, 1, dtype=torch.float64)))
        offset += t * tokens
    index, weight = _stack(parts)
    if index.shape[1] == 1:
        return index[:, 0], None
    return index, weight.float()


def packed_tokens(row: tuple[int, ...], tokens_per_frame: int, geometry: AnyresGeometry) -> int:
    """Rows `pack_taps` gives a grid row: base tokens + kept rows x (columns + newline), or per frame + 1."""
    if len(row) != 5:
        return row[0] * (tokens_per_frame + 1)
    s = geometry.side
    nh, nw = geometry.canvas_tiles(row[3], row[4])
    _, _, rows, cols = unpadded_region(row[3], row[4], nh * s, nw * s)
    shrunk = anyres_max_size(rows, cols, s, geometry.max_tiles) if geometry.max_tiles else None
    rows, cols = shrunk or (rows, cols)
    return s * s + rows * (cols + 1)
