"""Learned square position tables resampled to each frame's patch grid (Qwen3-VL, GLM-4.1V).

A checkpoint holds `side * side` learned vectors for a side x side grid. A frame of h x w patches
gets each patch's vector by interpolating that grid, one axis at a time:
  "bilinear", align_corners=True   -- corners map to corners (Qwen3-VL);
  "bicubic",  align_corners=False  -- half-pixel centres, Keys kernel a=-0.75, taps clamped to the
                                      border (GLM-4.1V: F.grid_sample(..., padding_mode="border");
                                      SigLIP at other sizes: F.interpolate(mode="bicubic"));
  "bilinear_antialias"             -- F.interpolate(mode="bilinear", align_corners=False, antialias=True):
                                      half-pixel centres, a triangle widened by the shrink factor when
                                      downsampling, weights normalised (SigLIP2 NaFlex).
The taps (table rows) and weights of one (h, w) frame are built on the host once and cached; the
lookup is one weighted `embedding_bag` over the whole pack, so no [T, taps, dim] intermediate.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.layers.grid import Grid
from mmenc.layers.rotary import grid_positions
from mmenc.utils.device_copy import to_device
from mmenc.utils.lru import LRUCache

_MODES = {"bilinear": (0, 2), "bicubic": (-1, 4), "bilinear_antialias": (0, 0)}  # -> (first tap offset, taps/axis)


def antialias_axis_taps(size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear antialiased resampling of a `side`-long axis to `size` positions (as F.interpolate with
    antialias=True): (taps int64 [size, n], weights float64 [size, n]), n the widest support; unused
    slots point at row 0 with weight 0."""
    scale = side / size
    support = max(scale, 1.0)
    center = (torch.arange(size, dtype=torch.float64) + 0.5) * scale - 0.5
    dense = (1 - (torch.arange(side, dtype=torch.float64)[None, :] - center[:, None]).abs() / support).clamp(min=0)
    dense = dense / dense.sum(-1, keepdim=True)  # [size, side]
    n = int((dense > 0).sum(-1).max())
    weights, taps = dense.topk(n, dim=-1)  # the nonzero taps first; zeros after them
    return torch.where(weights > 0, taps, torch.zeros_like(taps)), weights


def axis_taps(size: int, side: int, mode: str = "bilinear",
              align_corners: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Resampling a `side`-long axis to `size` positions: (taps int64 [size, n], weights float64 [size, n]).

    Output position i reads table rows taps[i] with weights[i] (n = 2 bilinear, 4 bicubic); rows
    past either end are clamped to the edge, as F.interpolate / grid_sample(padding_mode="border").
    """
    if mode not in _MODES:
        raise ValueError(f"interpolation mode {mode!r} is not known; expected one of {', '.join(_MODES)}")
    if mode == "bilinear_antialias":
        return antialias_axis_taps(size, side)
    first, n = _MODES[mode]
    i = torch.arange(size, dtype=torch.float64)
    if align_corners:
        src = i * (side - 1) / max(size - 1, 1)
    else:
        src = (i + 0.5) * side / size - 0.5
    floor = src.floor()
    offsets = torch.arange(first, first + n, dtype=torch.float64)
    taps = (floor[:, None] + offsets).clamp(0, side - 1).long()
    d = (src[:, None] - floor[:, None] - offsets).abs()  # [size, n] distance to each tap
    if mode == "bilinear":
        weights = (1 - d).clamp(min=0)
    else:
        a = -0.75
        near = ((a + 2) * d - (a + 3)) * d * d + 1
        far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
        weights = torch.where(d <= 1, near, far)
    return taps, weights


class InterpolatedPosEmbed(nn.Module):
    """A learned side x side position table (`weight` [side*side, dim]) resampled to each frame.

    `taps(grid, device)` -> (index int64 [T, n*n], weight float32 [T, n*n]) for a pack, patches of
    each frame in `grid_positions(h, w, merge_size)` order (merge-block order), frames repeated t
    times; compute it once per forward. `forward(index, weight)` -> [T, dim] float32.
    leading_rows: rows stored before the grid in `weight` and never read (HunyuanOCR's class token).
    """

    def __init__(self, num_positions: int, dim: int, *, mode: str = "bilinear", align_corners: bool = False,
                 merge_size: int = 1, leading_rows: int = 0, device=None, dtype=None, cache_size: int = 256):
        super().__init__()
        side = math.isqrt(num_positions)
        if side * side != num_positions:
            raise ValueError(f"num_positions={num_positions} is not a square; a learned position grid needs "
                             f"side * side entries")
        if mode not in _MODES:
            raise ValueError(f"interpolation mode {mode!r} is not known; expected one of {', '.join(_MODES)}")
        self.side, self.mode, self.align_corners, self.merge_size = side, mode, align_corners, merge_size
        self.leading_rows = leading_rows
        self.weight = nn.Parameter(torch.empty(leading_rows + num_positions, dim, device=device, dtype=dtype),
                                   requires_grad=False)
        self._frames = LRUCache(cache_size)

    def extra_repr(self) -> str:
        return (f"{self.side}x{self.side}, dim={self.weight.shape[1]}, mode={self.mode}, "
                f"align_corners={self.align_corners}")

    def frame_taps(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One h x w frame on the host: (index int64 [h*w, n*n], weight float32 [h*w, n*n])."""
        def make():
            rows_t, rows_w = axis_taps(h, self.side, self.mode, self.align_corners)
            cols_t, cols_w = axis_taps(w, self.side, self.mode, self.align_corners)
            pos = grid_positions(h, w, self.merge_size)  # [h*w, 2] (row, col)
            r, c = pos[:, 0], pos[:, 1]
            index = rows_t[r][:, :, None] * self.side + cols_t[c][:, None, :] + self.leading_rows  # [h*w, n, n]
            weight = rows_w[r][:, :, None] * cols_w[c][:, None, :]
            return index.flatten(1), weight.flatten(1).float()
        return self._frames.get((h, w), make)

    def taps(self, grid: Grid, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.frame_taps(h, w) for _, h, w in grid]
        width = max(i.shape[1] for i, _ in parts)  # antialiased taps vary per size: pad with weight 0
        parts = [(F.pad(i, (0, width - i.shape[1])), F.pad(wt, (0, width - wt.shape[1]))) for i, wt in parts]
        index = torch.cat([i.repeat(t, 1) for (t, _, _), (i, _) in zip(grid, parts)])
        weight = torch.cat([wt.repeat(t, 1) for (t, _, _), (_, wt) in zip(grid, parts)])
        return to_device(index, device), to_device(weight, device)

    def forward(self, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding_bag(index, self.weight.float(), per_sample_weights=weight, mode="sum")
