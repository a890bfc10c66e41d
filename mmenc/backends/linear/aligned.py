"""ALIGNED: F.linear on a weight whose input width is zero-padded once at load to a multiple of
`align_bytes`, each input padded the same way on every call (under torch.compile the pad fuses into
the kernel that produces the input). Zero columns add nothing to any sum: the result is F.linear's.

GPU GEMM libraries serve rows whose byte size is not 16-byte aligned with slow kernels: on an H200
cuBLAS ran Qwen2.5-VL-7B's down projection (3420 inputs, 6840-byte bf16 rows) on a cutlass sm80 kernel
at about 206 TFLOP/s, a third of what its aligned GEMMs reach (BENCHMARKS.md). torch.compile pads such
matmuls itself only where its own benchmark of the first shapes it compiles says so, a decision kept
in its on-disk cache; here the layout is fixed at load, in eager mode too.

    prepare(weight [out, in], bias) -> LinearState(weight: [out, in], a view of extras["padded"]
        [out, in_padded]; a weight already aligned is kept as loaded, and apply is then F.linear exactly)
    apply(state, x [..., in]) -> F.linear(pad(x), padded, bias) [..., out]

Memory: the padded weight replaces the loaded one (+36 columns of 3420 for that projection, 1%).
"""
from typing import ClassVar

import torch
import torch.nn.functional as F

from mmenc.backends.linear.base import LinearBackend, LinearState
from mmenc.backends.linear.enum import LinearBackendEnum


class AlignedLinear(LinearBackend):
    enum = LinearBackendEnum.ALIGNED
    not_batch_invariant = ("F.linear picks its kernel from each call's row count; batch-invariant mode runs "
                           "NATIVE's fixed token tiles (which align rows themselves)")
    defers_bias = True
    # Input rows are padded to a multiple of this many bytes.
    align_bytes: ClassVar[int] = 16

    @classmethod
    def _reasons(cls, device, dtype, quantization):
        return [f"runs unquantized weights only (quantization={quantization!r})"] if quantization else []

    @classmethod
    def padded_width(cls, in_features: int, element_size: int) -> int:
        """in_features rounded up so that a row takes a multiple of align_bytes."""
        step = max(1, cls.align_bytes // element_size)
        return -(-in_features // step) * step

    @classmethod
    def prepare(cls, weight, bias):
        k = weight.shape[1]
        width = cls.padded_width(k, weight.element_size())
        if width == k:
            return LinearState(weight, bias)
        padded = F.pad(weight.detach(), (0, width - k))
        return LinearState(padded[:, :k], bias, {"padded": padded})

    @classmethod
    def restore(cls, state):
        padded = state.extras.get("padded")
        return state.weight if padded is None else state.weight.contiguous()

    @classmethod
    def apply(cls, state, x):
        padded = state.extras.get("padded")
        if padded is None:
            return F.linear(x, state.weight, state.bias)
        return F.linear(F.pad(x, (0, padded.shape[1] - x.shape[-1])), padded, state.bias)

    @classmethod
    def apply_unbiased(cls, state, x):
        padded = state.extras.get("padded")
        if padded is None:
            return F.linear(x, state.weight)
        return F.linear(F.pad(x, (0, padded.shape[1] - x.shape[-1])), padded)

    @classmethod
    def state_nbytes(cls, state):
        padded = state.extras.get("padded")
        return (state.weight.nbytes if padded is None else 0) + state.nbytes()
