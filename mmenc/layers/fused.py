"""Fused row kernels at the layer level: what VisionBlock and the MLPs call when fusion is on.

    norm(norm_module, x, consumer=None) -> h                 norm(x); QuantizedRows when `consumer` takes FP8
    add_norm(norm_module, x, delta, consumer=None) -> (h, x + delta)        one pass over the rows
    act(act_module, x, gated, consumer=None, bias=None) -> h act(gate) * up (gated) or act(x); FP8 likewise
    linear_then_act(linear, act_module, x, gated, consumer)  act(linear(x)), the bias added in act's kernel

`consumer`: the linear that reads h. Where its backend takes inputs already in FP8
(`LinearBase.quantized_input_width`: the FP8 backend), h is produced quantized per token by the same
kernel, so the quantization costs no pass of its own. The kernels are the torch custom ops `mmenc::fused_*`
(registered by mmenc.backends.kernels.fused_rows when the platform checks them: Platform.fused_kernel_reasons);
this layer calls them through torch.ops, never the backend module.
Modules whose kind the kernels do not cover (a norm with other statistics, an activation without a
kernel) run their own forward. `use_fused_kernels(tower)` switches the blocks of a tower to these
helpers (the engine calls it with MultiModalConfig(fused_kernels=True) once the platform said the
kernels can run there: Platform.fused_kernel_reasons); off, the layers run the reference ops. Models
never call the kernels by name.
"""
import torch
import torch.nn as nn

from mmenc.backends.linear.fp8 import QuantizedRows
from mmenc.layers.activation import activation_kind
from mmenc.layers.norm import LayerNorm, RMSNorm


ACT_KINDS = ("silu", "gelu", "gelu_tanh", "quick_gelu")  # the activations the fused_act kernels compute


def _check_registered() -> None:
    """RuntimeError naming the fix when the fused row kernels (torch.ops.mmenc.fused_*) were never registered."""
    if not hasattr(torch.ops.mmenc, "fused_add_norm"):
        raise RuntimeError("the fused row kernels are not registered: build the tower with "
                           "MultiModalConfig(fused_kernels=True) (the platform checks and registers them)")


def _norm_args(norm_module: nn.Module):
    """(weight, bias, eps, kind) of an RMSNorm / affine LayerNorm, else None."""
    if isinstance(norm_module, RMSNorm):
        return norm_module.weight, None, norm_module.eps, "rms"
    if isinstance(norm_module, LayerNorm) and norm_module.weight is not None:
        return norm_module.weight, norm_module.bias, norm_module.eps, "layer"
    return None


def _width(consumer) -> int | None:
    return getattr(consumer, "quantized_input_width", None) if consumer is not None else None


def norm(norm_module: nn.Module, x: torch.Tensor, consumer=None):
    """norm_module(x) [..., D], or QuantizedRows of it (one kernel) where `consumer` takes FP8 inputs."""
    args, width = _norm_args(norm_module), _width(consumer)
    if args is None or width is None:
        return norm_module(x)  # a norm alone: torch's rms_norm / layer_norm is one pass already
    return QuantizedRows(*torch.ops.mmenc.fused_norm_fp8(x, *args, width))


def add_norm(norm_module: nn.Module, x: torch.Tensor, delta: torch.Tensor, consumer=None):
    """(norm_module(x + delta), x + delta) in one pass; the first QuantizedRows where `consumer` takes FP8."""
    args = _norm_args(norm_module)
    if args is None:
        x = x + delta
        return norm_module(x), x
    width = _width(consumer)
    if width is None:
        return tuple(torch.ops.mmenc.fused_add_norm(x, delta, *args))
    q, scale, x = torch.ops.mmenc.fused_add_norm_fp8(x, delta, *args, width)
    return QuantizedRows(q, scale), x


def act(act_module: nn.Module, x: torch.Tensor, gated: bool, consumer=None, bias: torch.Tensor | None = None):
    """act(gate) * up from x (+ bias) = [gate | up] (gated) or act(x + bias), in one pass; QuantizedRows where
    `consumer` takes FP8 inputs. bias: the producing linear's, left out of its GEMM (`linear_then_act`).
    Activations without a kernel run act_module."""
    kind = activation_kind(act_module)
    if kind not in ACT_KINDS:
        x = x + bias if bias is not None else x
        if gated:
            gate, up = x.chunk(2, dim=-1)
            return act_module(gate) * up
        return act_module(x)
    width = _width(consumer)
    if width is None:
        return torch.ops.mmenc.fused_act(x, kind, gated, bias)
    return QuantizedRows(*torch.ops.mmenc.fused_act_fp8(x, kind, gated, width, bias))


def linear_then_act(linear, act_module: nn.Module, x, gated: bool, consumer=None):
    """act(linear(x)) (gated: act(gate) * up of it) with the linear's bias added in the activation's kernel
    (one pass over the GEMM's output less) where the linear can leave it out."""
    y = linear.unbiased_matmul(x) if activation_kind(act_module) in ACT_KINDS else None
    if y is None:
        return act(act_module, linear(x), gated, consumer)
    return act(act_module, y, gated, consumer, bias=linear.kernel_bias)


def use_fused_kernels(module: nn.Module, enabled: bool = True) -> int:
    """Switch every block and MLP of `module` that has fused forms (VisionBlock, GatedVisionMLP, VisionMLP)
    to them (enabled=False: back to the reference ops); returns how many it set. Call before compiling.
    The kernels are checked here, once, not in the blocks' forwards (which torch.compile traces)."""
    if enabled:
        _check_registered()
    count = 0
    for m in module.modules():
        if hasattr(type(m), "fused_kernels"):
            m.fused_kernels = enabled
            count += 1
    return count
