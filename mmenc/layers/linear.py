"""Linear layers that shard over the tensor-parallel group, each parameter with its weight loader.

Every parameter carries `weight_loader(param, loaded, shard_id=None)`, which copies this rank's
slice of a full checkpoint tensor, so a rank never materialises the unsharded weight on device.
With tp_size 1 (or `tp_size=1` passed, as in data mode) they are plain linears.

  ReplicatedLinear       y = x W^T + b, full weight on every rank
  ColumnParallelLinear   output features split; y is this rank's slice (gather_output=False)
  RowParallelLinear      input features split; partial products summed with an all-reduce
  MergedColumnParallelLinear   several column-parallel outputs stacked in one matmul (gate, up)
  QKVParallelLinear      q, k, v stacked; each rank holds its heads of each
"""
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name or 'tensor'} has shape {tuple(loaded.shape)}; expected {tuple(param.shape)}")


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    """Copy a full (unsharded) tensor into `param`."""
    _check_shape(param, loaded)
    param.data.copy_(loaded)


class _LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_size: int | None,
                 device=None, dtype=None):
        super().__init__()
        self.tp_size = get_tp_size() if tp_size is None else tp_size
        self.tp_rank = get_tp_rank() if self.tp_size > 1 else 0
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class ReplicatedLinear(_LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None):
        super().__init__(in_features, out_features, bias, 1, device, dtype)


class ColumnParallelLinear(_LinearBase):
    """Splits the output features; returns this rank's [.., out_features / tp] slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_size: int | None = None,
                 device=None, dtype=None):
        tp = get_tp_size() if tp_size is None else tp_size
        self.out_per_rank = _divide(out_features, tp, "out_features")
        super().__init__(in_features, self.out_per_rank, bias, tp, device, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        n = self.out_per_rank
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(_LinearBase):
    """Several column-parallel projections of the same input in one matmul.
    Checkpoint tensors load by index: `weight_loader(param, loaded, shard_id=i)`."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = True,
                 tp_size: int | None = None, device=None, dtype=None):
        tp = get_tp_size() if tp_size is None else tp_size
        self.sizes_per_rank = [_divide(n, tp, "output size") for n in output_sizes]
        super().__init__(in_features, sum(self.sizes_per_rank), bias, tp, device, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError("MergedColumnParallelLinear needs shard_id (the index of the merged projection)")
        n = self.sizes_per_rank[shard_id]
        offset = sum(self.sizes_per_rank[:shard_id])
        target = param.data.narrow(0, offset, n)
        piece = loaded.narrow(0, self.tp_rank * n, n)
        _check_shape(target, piece)
        target.copy_(piece)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections stacked: [q heads | k heads | v heads], each split over ranks by heads.
    Loads a fused checkpoint tensor (shard_id=None, rows q|k|v) or separate ones ("q", "k", "v")."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, tp_size: int | None = None, device=None, dtype=None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        tp = get_tp_size() if tp_size is None else tp_size
        _divide(num_heads, tp, "num_heads")
        _divide(num_kv_heads, tp, "num_kv_heads")
        self.full_sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, self.full_sizes, bias, tp, device, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # fused q|k|v rows
            if loaded.shape[0] != sum(self.full_sizes):
                raise ValueError(f"fused qkv weight has {loaded.shape[0]} rows; expected {sum(self.full_sizes)}")
            for i, piece in enumerate(loaded.split(self.full_sizes, dim=0)):
                super().weight_loader(param, piece, i)
        else:
            super().weight_loader(param, loaded, {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id))


class RowParallelLinear(_LinearBase):
    """Splits the input features; each rank's partial product is summed over the group.
    The input is this rank's slice (as a ColumnParallelLinear produces); the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, tp_size: int | None = None,
                 device=None, dtype=None):
        tp = get_tp_size() if tp_size is None else tp_size
        self.in_per_rank = _divide(in_features, tp, "in_features")
        super().__init__(self.in_per_rank, out_features, bias, tp, device, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            default_weight_loader(param, loaded)
        else:
            n = self.in_per_rank
            default_weight_loader(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = tp_all_reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y
