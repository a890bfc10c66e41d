"""ONEDNN: oneDNN's inner product on the CPU, the weight reordered once at load into the blocked
layout its kernels read (torch.ops.mkldnn._reorder_linear_weight -> _linear_pointwise).

On a 2-core AMD EPYC (AVX-512, AVX512-BF16) one such linear took 0.67-0.83x the CPU time of
F.linear in float32 (MKL) and 0.88-0.95x in bfloat16 (F.linear already calls oneDNN there, reordering
the weight on every call); BENCHMARKS.md, CPU. The packed layout pads the weight's rows to a multiple
of 64 and its columns to 16 (32 in bfloat16): a 3420-row weight keeps 36 rows of zeros (+1%).
GELU after the matmul is fused as oneDNN's post-op (apply_activated): SigLIP so400m's fc1 [1458 x 1152 x
4304] took 0.88x the CPU time of the matmul then torch's GELU in bfloat16, 0.93x in float32.
The op is `mmenc::onednn_linear`, opaque to torch.compile (Inductor lowers oneDNN's op only for
weights frozen into the graph).
"""
import torch

from mmenc.backends.linear.base import LinearBackend, LinearState, dtype_name
from mmenc.backends.linear.enum import LinearBackendEnum

# activation kind (mmenc.layers.activation.activation_kind) -> oneDNN post-op (attr, algorithm)
POST_OPS = {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}
# Rows the packed layout is chosen for (oneDNN picks the same blocking for any count >= 64).
PACK_ROWS_HINT = 4096


class OneDNNLinear(LinearBackend):
    enum = LinearBackendEnum.ONEDNN
    fused_activations = frozenset(POST_OPS)
    not_batch_invariant = ("oneDNN picks its kernel from the row count of each call; batch-invariant mode runs "
                           "NATIVE's fixed token tiles")

    @classmethod
    def is_installed(cls) -> bool:
        return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    @classmethod
    def _reasons(cls, device, dtype, quantization):
        reasons = []
        if not cls.is_installed():
            reasons.append(f"this torch {torch.__version__} is built without oneDNN (torch.backends.mkldnn)")
        if device.type != "cpu":
            return reasons + [f"needs a cpu device, this is {device.describe()}"]
        if not device.features & {"avx2", "avx512"}:
            reasons.append("offered on x86 CPUs with AVX2 or AVX-512; this CPU has neither")
        if dtype == torch.bfloat16 and "avx512" not in device.features:
            reasons.append("bfloat16 needs AVX-512 (oneDNN's bf16 kernels); this CPU has AVX2 at most")
        elif dtype == torch.float16 and not device.features & {"amx_fp16"}:
            reasons.append("float16 needs AMX-FP16 (oneDNN's f16 kernels); use bfloat16 or float32")
        elif dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"{dtype_name(dtype)} is not supported (float32, bfloat16, float16)")
        if quantization:
            reasons.append(f"runs unquantized weights only (quantization={quantization!r})")
        return reasons

    @classmethod
    def prepare(cls, weight, bias):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS_HINT)
        return LinearState(packed, bias)

    @classmethod
    def apply(cls, state, x):
        return onednn_linear(x, state.weight, state.bias, "none", "")

    @classmethod
    def apply_activated(cls, state, x, activation):
        return onednn_linear(x, state.weight, state.bias, *POST_OPS[activation])

    @classmethod
    def restore(cls, state):
        return state.weight.to_dense()

    @classmethod
    def state_nbytes(cls, state):
        return torch.ops.mkldnn._nbytes(state.weight) + state.nbytes()


@torch.library.custom_op("mmenc::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, attr: str,
                  algorithm: str) -> torch.Tensor:
    """x [..., in] (the weight's dtype) -> x W^T + b [..., out], W oneDNN-packed [out, in], then the post-op
    `attr` ("none", "gelu") with `algorithm` ("", "none", "tanh")."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, attr, [], algorithm)


@onednn_linear.register_fake
def _(x, packed, bias, attr, algorithm):
    return x.new_empty(*x.shape[:-1], packed.shape[0])
