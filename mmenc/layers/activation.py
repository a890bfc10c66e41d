"""Activations by the names checkpoints' configs use (`hidden_act`), and the gated product of SwiGLU."""
import torch
import torch.nn as nn


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


def _gelu_tanh() -> nn.Module:
    return nn.GELU(approximate="tanh")


_ACTIVATIONS = {
    "silu": nn.SiLU,
    "swish": nn.SiLU,
    "gelu": nn.GELU,  # exact (erf) GELU
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "quick_gelu": QuickGELU,
    "relu": nn.ReLU,
}


def get_act_fn(name: str) -> nn.Module:
    """The activation module for a config's `hidden_act` name (e.g. "silu", "gelu", "quick_gelu")."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not known; expected one of {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]()


class ActAndMul(nn.Module):
    """x [..., 2*d] = [gate | up] -> act(gate) * up [..., d] (SwiGLU when act is silu)."""

    def __init__(self, act: str = "silu"):
        super().__init__()
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return self.act(gate) * up
