"""Activations by the names checkpoints' configs use (`hidden_act`), and the gated product of SwiGLU.

Batch invariance on the CPU: with torch's fused CPU kernels for GELU (erf and tanh), SiLU and sigmoid an
element's bits depend on where it sits in the tensor, i.e. on the other tokens of the call (measured:
the same values at other offsets and lengths differ in the last bits, for the last n % 32 elements of
float32 prefixes, as a scalar tail after the vector loop would; torch's source was not checked). `use_invariant_activations(module)` swaps every such activation for
`InvariantActivation`, which writes it with tanh, exp and erf (vectorised to the last element, partial
vectors included: one code path at every position) and IEEE arithmetic (+ - * /: the same bits scalar
or vector). The engine applies it with MultiModalConfig(batch_invariant=True) on the CPU; GPU kernels
have no scalar tail and keep torch's fused activations.
"""
import math

import torch
import torch.nn as nn


class QuickGELU(nn.Module):
    """x * sigmoid(1.702 x). `kernel`: None (torch's eager ops), or a function of x computing the same, set
    tower-wide where the platform has a faster one (mmenc.layers.compiled_kernels: CPUs)."""

    kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
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
        return self.act(gate).mul_(up)  # the activation's own fresh tensor: one [..., d] allocation, not two


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _sigmoid_scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / (1 + exp(-scale x)) = x * sigmoid(scale x); a fresh tensor."""
    return x / torch.exp(x * -scale).add_(1.0)


_FORMULAS = {
    "silu": lambda x: _sigmoid_scaled(x, 1.0),
    "quick_gelu": lambda x: _sigmoid_scaled(x, 1.702),
    "gelu": lambda x: torch.erf(x * math.sqrt(0.5)).add_(1.0).mul_(x).mul_(0.5),
    "gelu_tanh": lambda x: (x * x).mul_(x).mul_(0.044715).add_(x).mul_(_SQRT_2_OVER_PI).tanh_().add_(1.0)
    .mul_(x).mul_(0.5),
}


@torch.library.custom_op("mmenc::invariant_activation", mutates_args=())
def invariant_activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    """`kind` ("silu", "quick_gelu", "gelu", "gelu_tanh") of x [...] -> [...], each element's bits
    independent of its position (see the module docstring); float16/bfloat16 compute in float32.
    A custom op, opaque to torch.compile: Inductor would fuse the formula into a loop of its own."""
    if kind not in _FORMULAS:
        raise ValueError(f"kind={kind!r} is not an invariant activation; expected one of {', '.join(_FORMULAS)}")
    xf = x.float().contiguous() if x.dtype in (torch.float16, torch.bfloat16) else x.contiguous()
    return _FORMULAS[kind](xf).to(x.dtype)


@invariant_activation.register_fake
def _(x, kind):
    return torch.empty_like(x)


class InvariantActivation(nn.Module):
    """An activation whose output for an element depends only on that element (CPU batch invariance)."""

    def __init__(self, kind: str):
        super().__init__()
        if kind not in _FORMULAS:
            raise ValueError(f"kind={kind!r} is not an invariant activation; expected one of {', '.join(_FORMULAS)}")
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return invariant_activation(x, self.kind)

    def extra_repr(self) -> str:
        return self.kind


def activation_kind(module: nn.Module) -> str | None:
    """The name of a standard activation module ("silu", "quick_gelu", "gelu", "gelu_tanh": the
    InvariantActivation kind replacing it, the post-op a linear backend may fuse), or None."""
    if isinstance(module, nn.SiLU):
        return "silu"
    if isinstance(module, QuickGELU):
        return "quick_gelu"
    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_tanh"}[module.approximate]
    return None


def use_invariant_activations(module: nn.Module) -> int:
    """Replace every GELU (erf or tanh), SiLU and QuickGELU submodule of `module` (blocks, mergers, heads,
    ActAndMul's act) by the InvariantActivation of the same function; returns how many it replaced.
    For batch invariance on the CPU; call before compiling. ReLU and other exact ops stay."""
    swaps = [(parent, name, kind) for parent in module.modules() for name, child in parent.named_children()
             if (kind := activation_kind(child)) is not None]
    for parent, name, kind in swaps:
        setattr(parent, name, InvariantActivation(kind))
    return len(swaps)
