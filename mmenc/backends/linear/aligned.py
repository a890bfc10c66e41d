"""ALIGNED: F.linear where the input width of the weight is not a multiple of 16 bytes, run eagerly with
both operands zero-padded to it on each call. Zero columns add nothing to any sum: the result is F.linear's.

GPU GEMM libraries serve rows whose byte size is not 16-byte aligned with slow kernels: on an H200,
cuBLAS ran Qwen2.5-VL-7B's down projection (3420 inputs, 6840-byte bf16 rows; 43,808 x 3420 x 1280) at
220 TFLOP/s, and at 715 with 3424 columns; the eager tower takes 219.5 ms at 8 x 1036 px against NATIVE's
244.9 (BENCHMARKS.md, fifteenth session). The weight is padded on each call (8.8 MB there, a few
microseconds; padded once at load it was 217.3 ms), so the loaded tensor stays the only copy; the input's
pad is the price (a pass over it).

Under torch.compile it is NATIVE exactly (F.linear): Inductor aligns such matmuls itself (padded strides
or padded operands), and a pad written into the graph made its elementwise kernels slower (28.7 against
26.4 ms per call; the compiled tower 135.3 against 135.2 ms, same host).

    prepare(weight [out, in], bias) -> LinearState(weight as loaded, bias): nothing is repacked
    apply(state, x [..., in]) -> [..., out]
"""
from typing import ClassVar

import torch
import torch.nn.functional as F

from mmenc.backends.linear.enum import LinearBackendEnum
from mmenc.backends.linear.native import NativeLinear


class AlignedLinear(NativeLinear):
    """NATIVE's weight handling (kept as loaded) and reasons, with the eager pad in apply."""

    enum = LinearBackendEnum.ALIGNED
    not_batch_invariant = ("F.linear picks its kernel from each call's row count; batch-invariant mode runs "
                           "NATIVE's fixed token tiles (which align rows themselves)")
    # Input rows are padded to a multiple of this many bytes.
    align_bytes: ClassVar[int] = 16

    @classmethod
    def padded_width(cls, in_features: int, element_size: int) -> int:
        """in_features rounded up so that a row takes a multiple of align_bytes."""
        step = max(1, cls.align_bytes // element_size)
        return -(-in_features // step) * step

    @classmethod
    def apply(cls, state, x):
        return cls._linear(x, state.weight, state.bias)

    @classmethod
    def apply_unbiased(cls, state, x):
        return cls._linear(x, state.weight, None)

    @classmethod
    def _linear(cls, x, weight, bias):
        pad = cls.padded_width(weight.shape[1], weight.element_size()) - weight.shape[1]
        if not pad or torch.compiler.is_compiling():
            return F.linear(x, weight, bias)
        return F.linear(F.pad(x, (0, pad)), F.pad(weight, (0, pad)), bias)
