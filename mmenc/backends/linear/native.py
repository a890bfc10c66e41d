"""NATIVE: F.linear on the weight as loaded. The reference, and what every device can run; the
layer's batch-invariant token tiles (mmenc.layers.token_tiles) run on it."""
import torch.nn.functional as F

from mmenc.backends.linear.base import LinearBackend, LinearState
from mmenc.backends.linear.enum import LinearBackendEnum


class NativeLinear(LinearBackend):
    enum = LinearBackendEnum.NATIVE
    not_batch_invariant = None  # with the layer's fixed token tiles
    defers_bias = True

    @classmethod
    def _reasons(cls, device, dtype, quantization):
        return [f"runs unquantized weights only (quantization={quantization!r})"] if quantization else []

    @classmethod
    def prepare(cls, weight, bias):
        return LinearState(weight, bias)

    @classmethod
    def restore(cls, state):
        return state.weight

    @classmethod
    def apply(cls, state, x):
        return F.linear(x, state.weight, state.bias)

    @classmethod
    def apply_unbiased(cls, state, x):
        return F.linear(x, state.weight)
