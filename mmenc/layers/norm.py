"""Normalisations used by vision towers: RMSNorm, GemmaRMSNorm (its weight an offset from 1), LayerNorm, and
ShardedRMSNorm (an RMSNorm over a width split across tensor-parallel ranks), all with `device=None, dtype=None`."""
import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics in float32, the result in x's dtype
    (torch's fused rms_norm; transformers rounds x / rms to x's dtype before the weight multiply,
    which differs by at most one rounding step in bf16).

    x [..., hidden] -> [..., hidden]. Parameter: weight [hidden] (checkpoint name `weight`).
    `kernel`: None (torch's rms_norm), or a function (x, weight, eps) computing the same, set tower-wide
    where the platform has a faster one (mmenc.layers.compiled_kernels: CPUs).
    """

    kernel = None

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # fused; float32 statistics

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: y = (x / sqrt(mean(x^2) + eps)) * (1 + weight), all in float32, the result in x's
    dtype (transformers' Gemma3RMSNorm; the checkpoint stores the offset from 1, zeros at init).

    x [..., hidden] -> [..., hidden]. Parameter: weight [hidden] (checkpoint name `weight`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ShardedRMSNorm(nn.Module):
    """RMSNorm over `width` features of which this rank holds `shard` (its slice, in rank order, as a
    column-parallel output): the mean square is summed over the tensor-parallel group, so every rank
    normalises by the statistics of the whole width (InternViT-6B's q/k norm over all heads).

    x [..., shard] -> [..., shard] in x's dtype. Parameter: weight [shard], loaded from the
    checkpoint's full [width] by this rank's slice.
    """

    def __init__(self, width: int, shard: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.width, self.eps = width, eps
        self.tp_size = get_tp_size()
        self.rank = get_tp_rank() if self.tp_size > 1 else 0
        if shard * self.tp_size != width:
            raise ValueError(f"ShardedRMSNorm: shard={shard} x tensor-parallel size {self.tp_size} != width={width}; "
                             f"expected the width split evenly over the ranks")
        self.weight = nn.Parameter(torch.ones(shard, device=device, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load

    def _load(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != (self.width,):
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected ({self.width},)")
        param.data.copy_(loaded.narrow(0, self.rank * param.shape[0], param.shape[0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        xf = x.float()
        square_sum = tp_all_reduce(xf.pow(2).sum(-1, keepdim=True))  # [..., 1] over the whole width
        return (xf * torch.rsqrt(square_sum / self.width + self.eps)).to(x.dtype) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]} of {self.width}, eps={self.eps}"


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight and bias), parameters not requiring grad: towers run inference only."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, bias: bool = True, device=None, dtype=None):
        super().__init__(hidden_size, eps=eps, bias=bias, device=device, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)


def make_norm(kind: str, hidden_size: int, eps: float = 1e-6, device=None, dtype=None) -> nn.Module:
    """kind "rms" -> RMSNorm, "layer" -> LayerNorm."""
    if kind == "rms":
        return RMSNorm(hidden_size, eps, device=device, dtype=dtype)
    if kind == "layer":
        return LayerNorm(hidden_size, eps, device=device, dtype=dtype)
    raise ValueError(f"norm kind {kind!r} is not known; expected 'rms' or 'layer'")
