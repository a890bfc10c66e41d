"""Linear layers that shard over the tensor-parallel group, each parameter with its weight loader.

Every parameter carries `weight_loader(param, loaded, shard_id=None)`, which copies this rank's
slice of a full checkpoint tensor: the loader only takes views (`narrow`, `split`) of `loaded` and
copies the slice into the parameter, so a rank never materialises the unsharded weight on device
(`loaded` may be a memory-mapped CPU tensor; only this rank's rows are read).
The tensor-parallel size and rank are read from `mmenc.distributed.parallel_state` when a layer is
built: set the group first (`set_tp_group`); with no group set (one process, or data mode) they are
plain linears.

  ReplicatedLinear       y = x W^T + b, full weight on every rank
  ColumnParallelLinear   output features split; y is this rank's slice (or gathered: gather_output)
  RowParallelLinear      input features split; partial products summed with an all-reduce
  MergedColumnParallelLinear   several column-parallel outputs stacked in one matmul (gate, up)
  QKVParallelLinear      q, k, v stacked; each rank holds its heads of each (kv heads replicated
                         when there are fewer of them than ranks)

Shapes: x [..., in_features] -> y [..., out] with `out` this rank's share for the column layers.

The linears' kernel backends and token tiles are set tower-wide by mmenc.layers.linear_kernels
(prepare_linears, restore_linears, use_token_tiles); forward then runs the backend's kernel.
"""
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.backends.linear import LinearBackend, LinearState
from mmenc.backends.linear.fp8 import QuantizedRows
from mmenc.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_gather, tp_all_reduce
from mmenc.layers.activation import activation_kind
from mmenc.layers.token_tiles import tiled_linear


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}; "
                         f"use a tensor-parallel size that divides it, or mm_encoder_tp_mode='data'")
    return n // d


def _check_shape(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"weight {name or 'tensor'} has shape {tuple(loaded.shape)}; expected {tuple(param.shape)}")


def _current_tp() -> tuple[int, int]:
    """(tp_size, tp_rank) of the tensor-parallel group set now; (1, 0) without one."""
    tp = get_tp_size()
    return tp, (get_tp_rank() if tp > 1 else 0)


class LinearBase(nn.Module):
    """A linear over this rank's [out_features, in_features] weight; `tp` is (tp_size, tp_rank).
    `token_tile`: None, or the token-tile size its matmul runs over (set by `use_token_tiles`).
    `linear_backend`, `linear_state`: the kernel backend its matmul runs on and its form of the weight
    (set by `prepare_linears`, mmenc.layers.linear_kernels; None: F.linear on the weight as loaded)."""

    token_tile: int | None = None
    linear_backend: type[LinearBackend] | None = None
    linear_state: LinearState | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: tuple[int, int],
                 prefix: str = "", device=None, dtype=None):
        super().__init__()
        self.tp_size, self.tp_rank = tp
        self.prefix = prefix
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(out_features, device=device, dtype=dtype), requires_grad=False)
                     if bias else None)
        for p in self.parameters():
            p.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded, shard_id=None):
        _check_shape(param, loaded, self._pname(param))
        param.data.copy_(loaded)

    def _pname(self, param) -> str:
        which = "bias" if param is self.bias else "weight"
        return f"{self.prefix}.{which}" if self.prefix else which

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        """The bias the matmul itself adds (a row-parallel linear adds its own after the all-reduce)."""
        return self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] -> x W^T (+ kernel_bias) [..., out]: the backend's kernel, or over fixed token tiles
        when token_tile is set. x may be QuantizedRows (a fused kernel's FP8 output, mmenc.layers.fused)
        where the backend takes them (`quantized_input_width`)."""
        if isinstance(x, QuantizedRows):
            return self.linear_backend.apply_quantized(self.linear_state, x)
        if self.token_tile is not None:
            return tiled_linear(x, self.weight, self.kernel_bias, self.token_tile)
        if self.linear_state is not None:
            return self.linear_backend.apply(self.linear_state, x)
        return F.linear(x, self.weight, self.kernel_bias)

    def unbiased_matmul(self, x) -> torch.Tensor | None:
        """x W^T without kernel_bias, for a fused kernel after it to add (mmenc.layers.fused.act), or None
        where the linear cannot leave it out (no bias, token tiles, a backend that cannot)."""
        if self.kernel_bias is None or self.token_tile is not None or getattr(self, "gather_output", False):
            return None
        if self.linear_state is None:
            return F.linear(x, self.weight)
        if not self.linear_backend.defers_bias:
            return None
        return self.linear_backend.apply_unbiased(self.linear_state, x)

    @property
    def quantized_input_width(self) -> int | None:
        """Columns of the QuantizedRows this linear takes as input (its backend's padded K), or None where it
        takes plain tensors only."""
        backend = self.linear_backend
        if backend is None or not backend.takes_quantized_input or self.token_tile is not None:
            return None
        return backend.input_width(self.linear_state)

    def forward_activated(self, x: torch.Tensor, act: nn.Module) -> torch.Tensor:
        """act(self(x)): the activation fused into the matmul where the backend can (a standard GELU on
        ONEDNN), else run after it (NATIVE: exactly act(self(x)))."""
        kind = activation_kind(act)
        backend = self.linear_backend
        if (backend is not None and kind in backend.fused_activations and self.token_tile is None
                and self.kernel_bias is self.bias and not getattr(self, "gather_output", False)):
            return backend.apply_activated(self.linear_state, x, kind)
        return act(self(x))

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        tiles = f", token_tile={self.token_tile}" if self.token_tile is not None else ""
        backend = f", backend={self.linear_backend.enum.name}" if self.linear_backend is not None else ""
        return (f"in_features={inp}, out_features={out} (per rank), bias={self.bias is not None}, "
                f"tp={self.tp_size}{tiles}{backend}")


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        super().__init__(in_features, out_features, bias, (1, 0), prefix, device, dtype)


class ColumnParallelLinear(LinearBase):
    """Splits the output features; returns this rank's [.., out_features / tp] slice, or the full
    [.., out_features] with `gather_output=True` (an all-gather)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 prefix: str = "", device=None, dtype=None):
        tp = _current_tp()
        self.out_per_rank = _divide(out_features, tp[0], f"{prefix or 'ColumnParallelLinear'}: out_features")
        super().__init__(in_features, self.out_per_rank, bias, tp, prefix, device, dtype)
        self.gather_output = gather_output

    def weight_loader(self, param, loaded, shard_id=None):
        n = self.out_per_rank
        if loaded.shape[0] != n * self.tp_size:
            raise ValueError(f"{self._pname(param)} has shape {tuple(loaded.shape)}; expected {n * self.tp_size} "
                             f"rows (the unsharded output features)")
        super().weight_loader(param, loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return tp_all_gather(y, dim=-1) if self.gather_output and self.tp_size > 1 else y


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel projections of the same input in one matmul; this rank's output is
    [its slice of projection 0 | its slice of projection 1 | ...].
    Checkpoint tensors load by index: `weight_loader(param, loaded, shard_id=i)`."""

    def __init__(self, in_features: int, output_sizes: Sequence[int], bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        tp = _current_tp()
        self.full_sizes = list(output_sizes)
        # this rank's rows of each projection, and which slice (index into the projection) they are
        self.sizes_per_rank, self.shard_index = self._plan(self.full_sizes, *tp, prefix or type(self).__name__)
        super().__init__(in_features, sum(self.sizes_per_rank), bias, tp, prefix, device, dtype)

    def _plan(self, full_sizes: list[int], tp: int, rank: int, name: str) -> tuple[list[int], list[int]]:
        return [_divide(n, tp, f"{name}: output size") for n in full_sizes], [rank] * len(full_sizes)

    def _shard_id(self, shard_id) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.sizes_per_rank):
            raise ValueError(f"{self.prefix or type(self).__name__}: shard_id={shard_id!r} is not valid; expected an "
                             f"index 0..{len(self.sizes_per_rank) - 1} of the merged projections")
        return shard_id

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            raise ValueError(f"{self.prefix or 'MergedColumnParallelLinear'}: weight_loader needs shard_id "
                             f"(the index of the merged projection)")
        i = self._shard_id(shard_id)
        if loaded.shape[0] != self.full_sizes[i]:
            raise ValueError(f"{self._pname(param)} shard {shard_id!r} has {loaded.shape[0]} rows; "
                             f"expected {self.full_sizes[i]}")
        n, offset = self.sizes_per_rank[i], sum(self.sizes_per_rank[:i])
        target = param.data.narrow(0, offset, n)
        piece = loaded.narrow(0, self.shard_index[i] * n, n)  # a view: only this rank's rows are read
        _check_shape(target, piece, self._pname(param))
        target.copy_(piece)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections stacked: [q heads | k heads | v heads], each split over ranks by heads.
    Loads a fused checkpoint tensor (shard_id=None, rows q|k|v) or separate ones ("q", "k", "v").
    With fewer kv heads than ranks (tp % num_kv_heads == 0) each kv head is replicated on
    tp / num_kv_heads ranks. Per-rank head counts: `num_heads_per_rank`, `num_kv_heads_per_rank`."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int | None = None,
                 bias: bool = True, prefix: str = "", device=None, dtype=None):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        tp, _ = _current_tp()
        name = prefix or "QKVParallelLinear"
        self.num_heads_per_rank = _divide(num_heads, tp, f"{name}: num_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads_per_rank = _divide(num_kv_heads, tp, f"{name}: num_kv_heads")
        elif tp % num_kv_heads:
            raise ValueError(f"{name}: num_kv_heads={num_kv_heads} is fewer than the tensor-parallel size {tp} "
                             f"and does not divide it; expected tp to be a multiple of num_kv_heads")
        else:
            self.num_kv_heads_per_rank = 1
        self.head_size, self.num_heads, self.num_kv_heads = head_size, num_heads, num_kv_heads
        sizes = [num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
        super().__init__(hidden_size, sizes, bias, prefix, device, dtype)

    def _plan(self, full_sizes, tp, rank, name):
        # kv heads shared by tp / num_kv_heads ranks when there are fewer of them than ranks
        kv_index = rank if self.num_kv_heads >= tp else rank // (tp // self.num_kv_heads)
        q, kv = self.num_heads_per_rank * self.head_size, self.num_kv_heads_per_rank * self.head_size
        return [q, kv, kv], [rank, kv_index, kv_index]

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:  # fused q|k|v rows
            if loaded.shape[0] != sum(self.full_sizes):
                raise ValueError(f"{self._pname(param)}: fused qkv tensor has {loaded.shape[0]} rows; "
                                 f"expected {sum(self.full_sizes)} (q {self.full_sizes[0]} + k {self.full_sizes[1]} "
                                 f"+ v {self.full_sizes[2]})")
            for i, piece in enumerate(loaded.split(self.full_sizes, dim=0)):  # views
                super().weight_loader(param, piece, i)
            return
        if shard_id not in ("q", "k", "v", 0, 1, 2):
            raise ValueError(f"{self._pname(param)}: shard_id={shard_id!r} is not valid; expected 'q', 'k', 'v' "
                             f"or None (fused q|k|v)")
        super().weight_loader(param, loaded, {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id))


class RowParallelLinear(LinearBase):
    """Splits the input features; each rank's partial product is summed over the group.
    The input is this rank's slice (as a ColumnParallelLinear produces); the bias is added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        tp = _current_tp()
        self.in_per_rank = _divide(in_features, tp[0], f"{prefix or 'RowParallelLinear'}: in_features")
        super().__init__(self.in_per_rank, out_features, bias, tp, prefix, device, dtype)

    def weight_loader(self, param, loaded, shard_id=None):
        if param is self.bias:
            super().weight_loader(param, loaded)
        else:
            n = self.in_per_rank
            if loaded.dim() != 2 or loaded.shape[1] != n * self.tp_size:
                raise ValueError(f"{self._pname(param)} has shape {tuple(loaded.shape)}; expected {n * self.tp_size} "
                                 f"columns (the unsharded input features)")
            super().weight_loader(param, loaded.narrow(1, self.tp_rank * n, n))

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        return self.bias if self.tp_size == 1 else None  # added once, after the all-reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x)
        y = tp_all_reduce(self._matmul(x))
        return y + self.bias if self.bias is not None else y


def tp_sharded_sizes(module: nn.Module) -> dict[str, int]:
    """Every size the tensor-parallel linears in `module` split over ranks, keyed by layer name
    (e.g. "blocks.0.attn.qkv.num_heads", "blocks.0.mlp.fc1.out_features"). Weights mode over N ranks
    needs each divisible by N. Build the module with no tensor-parallel group set (device="meta" costs nothing)."""
    sizes = {}
    for name, m in module.named_modules():
        if isinstance(m, QKVParallelLinear):
            sizes[f"{name}.num_heads"] = m.num_heads
        elif isinstance(m, MergedColumnParallelLinear):
            sizes.update({f"{name}.output_sizes[{i}]": n for i, n in enumerate(m.full_sizes)})
        elif isinstance(m, ColumnParallelLinear):
            sizes[f"{name}.out_features"] = m.out_per_rank * m.tp_size
        elif isinstance(m, RowParallelLinear):
            sizes[f"{name}.in_features"] = m.in_per_rank * m.tp_size
    return sizes
