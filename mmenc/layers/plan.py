"""What a tower's forward derives from `grid_thw`, once per pack: the `PackPlan`.

A plan holds device tensors built from the host-side grid (attention segments, rotary tables, a
learned position table's taps, token permutations); the tower base caches plans per (grid, device),
so a repeated packing costs one dictionary lookup (see mmenc.models.base.VisionTower.plan).
"""
import dataclasses

import torch

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import VisionRotary2D


@dataclasses.dataclass
class PackPlan:
    """Attention segments (cu_seqlens int32 [S+1]) and rotary tables (cos, sin float32 [T, head_dim]) on
    the device; optionally a learned position table's taps (pos_index int64 / pos_weight float32
    [T, taps]) and, for window attention, the window segments and the token permutations."""

    num_patches: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    cos: torch.Tensor
    sin: torch.Tensor
    pos_index: torch.Tensor | None = None
    pos_weight: torch.Tensor | None = None
    cu_window_seqlens: torch.Tensor | None = None
    max_window_seqlen: int = 0
    token_order: torch.Tensor | None = None  # int64 [T]: patch i of the pack is original patch token_order[i]
    merged_inverse: torch.Tensor | None = None  # int64 [T / m^2]: restores image order after the merger


def frame_plan(grid: Grid, device, rotary: VisionRotary2D, pos_embed: InterpolatedPosEmbed | None = None) -> PackPlan:
    """The plan of a pack whose every frame attends to itself (h*w tokens, t times per item), tokens in
    the rotary table's order; with `pos_embed`, its taps for every patch too."""
    cu, max_len = make_cu_seqlens(frame_lengths(grid), device)
    cos, sin = rotary.tables(grid, device)
    index, weight = pos_embed.taps(grid, device) if pos_embed is not None else (None, None)
    return PackPlan(num_patches(grid), cu, max_len, cos, sin, pos_index=index, pos_weight=weight)
