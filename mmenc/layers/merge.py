"""Patch-merging heads shared by the GLM-4V lineage and HunyuanOCR (tokens in merge-block order).

  ConvDownsample  a merge x merge convolution with stride merge, run as one matmul over each block's
                  m*m contiguous patches: x [T, dim] -> [T / m^2, out_dim] (replicated over TP ranks)
  merge_block_order  raster-ordered pixel rows -> merge-block order, as a gather index (host, int64 [T])
  GatedMerger     proj (column, gathered) -> LayerNorm (eps 1e-5) -> GELU -> SwiGLU (GatedVisionMLP)
                  x [N, dim] -> [N, dim]  (GLM-4.1V / GLM-4.5V / GLM-OCR `merger`)
"""
import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, ReplicatedLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.rotary import grid_positions
from mmenc.layers.vision_blocks import GatedVisionMLP


def merge_block_order(grid: Grid, merge_size: int) -> torch.Tensor:
    """int64 [T] on the host: row i of a merge-block-ordered pack is row order[i] of the pack whose
    frames hold their patches in raster order (processors that emit raster rows: PaddleOCR-VL, HunyuanOCR)."""
    parts, offset = [], 0
    for t, h, w in grid:
        pos = grid_positions(h, w, merge_size)  # [h*w, 2] (row, col) in merge-block order
        raster = pos[:, 0] * w + pos[:, 1]
        parts.append((torch.arange(t)[:, None] * h * w + raster).reshape(-1) + offset)
        offset += t * h * w
    return torch.cat(parts)


class ConvDownsample(ReplicatedLinear):
    """Conv2d(dim, out_dim, kernel=merge, stride=merge) over merge-block-ordered tokens.

    forward(x [T, dim]) -> [T / merge^2, out_dim]. `weight` [out_dim, m*m*dim] loads the checkpoint's
    conv weight [out_dim, dim, m, m] (permuted: input rows are m*m patches of dim features each).
    """

    def __init__(self, dim: int, out_dim: int, merge_size: int, bias: bool = True, prefix: str = "downsample",
                 device=None, dtype=None):
        super().__init__(merge_size * merge_size * dim, out_dim, bias=bias, prefix=prefix, device=device, dtype=dtype)
        self.dim, self.out_dim, self.merge_size = dim, out_dim, merge_size
        self.weight.weight_loader = self._load_conv_weight

    def _load_conv_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        m = self.merge_size
        if tuple(loaded.shape) != (self.out_dim, self.dim, m, m):
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected the {self.prefix} convolution "
                             f"weight {(self.out_dim, self.dim, m, m)}")
        # [out, C, m, m] -> [out, m, m, C]
        param.data.copy_(loaded.permute(0, 2, 3, 1).reshape(param.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, self.merge_size ** 2 * self.dim))


class GatedMerger(GatedVisionMLP):
    """x [N, dim] -> down(act(gate(y)) * up(y)) with y = GELU(LayerNorm(proj(x))) [N, dim]. proj is
    column-parallel with its output gathered (the LayerNorm needs the whole vector); gate_up / down
    split as in GatedVisionMLP (no biases)."""

    def __init__(self, dim: int, context_dim: int, act: str, prefix: str = "merger", device=None, dtype=None):
        super().__init__(dim, context_dim, act=act, bias=False, prefix=prefix, device=device, dtype=dtype)
        self.proj = ColumnParallelLinear(dim, dim, bias=False, gather_output=True, prefix=f"{prefix}.proj",
                                         device=device, dtype=dtype)
        self.post_projection_norm = LayerNorm(dim, eps=1e-5, device=device, dtype=dtype)
        self.act1 = nn.GELU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(self.act1(self.post_projection_norm(self.proj(x))))
