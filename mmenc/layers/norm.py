"""Normalisations used by vision towers: RMSNorm and LayerNorm, both with `device=None, dtype=None`."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), the statistics in float32, the result in x's dtype
    (torch's fused rms_norm; transformers rounds x / rms to x's dtype before the weight multiply,
    which differs by at most one rounding step in bf16).

    x [..., hidden] -> [..., hidden]. Parameter: weight [hidden] (checkpoint name `weight`).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)  # fused; float32 statistics

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


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
