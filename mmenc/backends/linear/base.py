"""The contract every linear backend follows.

    reasons(device: DeviceInfo, dtype, quantization) -> list[str]     empty: it can run there
    prepare(weight [out, in], bias [out] | None) -> LinearState        once, after the weights are loaded
    apply(state, x [..., in]) -> [..., out]                            x's dtype; y = x W^T + b
    apply_activated(state, x, "gelu_tanh") -> act(x W^T + b)           where fused_activations has it
    apply_unbiased(state, x) -> x W^T                                  where defers_bias
    restore(state) -> weight [out, in]                                 the plain weight back (optional)

`prepare` may repack or quantize the weight; its LinearState REPLACES the layer's weight (the layer
keeps no second copy), and `state.weight.shape` stays [out, in] whatever its layout.
"""
import dataclasses
from typing import ClassVar

import torch

from mmenc.backends.device import DeviceInfo
from mmenc.backends.linear.enum import LinearBackendEnum

# "fp8": FP8 linears where accuracy holds (the last quarter of the blocks); "fp8-all": every linear
QUANTIZATIONS = ("fp8", "fp8-all")


@dataclasses.dataclass(eq=False)
class LinearState:
    """One linear's weight in a backend's form. weight: [out, in] as the backend keeps it (NATIVE: the
    loaded tensor itself; ONEDNN: oneDNN's packed layout); bias [out] or None; extras: tensors the
    backend needs beside them (e.g. FP8's per-channel scales [out])."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    out_dtype: torch.dtype | None = None  # the output's dtype where the weight's is not it (FP8)

    def nbytes(self) -> int:
        """Bytes the state holds (packed layouts may pad; see LinearBackend.state_nbytes)."""
        return sum(t.nbytes for t in (self.bias, *self.extras.values()) if t is not None)


class LinearBackend:
    enum: ClassVar[LinearBackendEnum]
    # Why the backend cannot give batch-invariant results (MultiModalConfig(batch_invariant=True)), or
    # None where it can (a row's result independent of the other rows of the call).
    not_batch_invariant: ClassVar[str | None] = "the backend does not declare it"
    # Activations `apply_activated` fuses into the matmul ("gelu", "gelu_tanh", ...; mmenc.layers.activation).
    fused_activations: ClassVar[frozenset[str]] = frozenset()
    # Whether `apply_quantized(state, QuantizedRows)` takes an input already in FP8 (a fused kernel quantized
    # it: mmenc.layers.fused), `input_width(state)` columns wide.
    takes_quantized_input: ClassVar[bool] = False
    # Whether `apply_unbiased(state, x)` gives x W^T without the bias (a fused kernel after it adds the bias).
    defers_bias: ClassVar[bool] = False

    @classmethod
    def is_installed(cls) -> bool:
        return True

    @classmethod
    def reasons(cls, device: DeviceInfo, dtype: torch.dtype, quantization: str | None,
                batch_invariant: bool = False) -> list[str]:
        """Why this backend cannot run `dtype` (quantized as `quantization`) linears on `device`
        (batch-invariantly, when asked); an empty list means it can."""
        reasons = []
        if batch_invariant and cls.not_batch_invariant:
            reasons.append(f"not batch invariant: {cls.not_batch_invariant}")
        return reasons + cls._reasons(device, dtype, quantization)

    @classmethod
    def _reasons(cls, device: DeviceInfo, dtype: torch.dtype, quantization: str | None) -> list[str]:
        return []

    @classmethod
    def prepare(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> LinearState:
        raise NotImplementedError

    @classmethod
    def apply(cls, state: LinearState, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def apply_unbiased(cls, state: LinearState, x) -> torch.Tensor:
        """x W^T [..., out] without state.bias, where defers_bias (the kernel reading the output adds it)."""
        raise NotImplementedError(f"the {cls.enum.name} linear backend cannot leave its bias out")

    @classmethod
    def apply_activated(cls, state: LinearState, x: torch.Tensor, activation: str) -> torch.Tensor:
        """activation(x W^T + b) [..., out] in one kernel, for `activation` in fused_activations."""
        raise NotImplementedError(f"the {cls.enum.name} linear backend fuses no activation ({activation!r})")

    @classmethod
    def restore(cls, state: LinearState) -> torch.Tensor:
        """The plain weight [out, in] back from `state` (to load other weights into it)."""
        raise NotImplementedError(f"the {cls.enum.name} linear backend cannot give its weights back; build the "
                                  f"tower again to load other weights")

    @classmethod
    def state_nbytes(cls, state: LinearState) -> int:
        """Bytes `state` holds, its weight's real (padded) layout included."""
        return state.weight.nbytes + state.nbytes()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
