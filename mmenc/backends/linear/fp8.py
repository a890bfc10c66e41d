"""FP8: e4m3 weights scaled per output channel (quantized once at load), activations scaled per token
(dynamically, on every call), one `torch._scaled_mm` (Hopper / Ada FP8 tensor cores) with the scales
applied in its epilogue and the output in the tower's dtype.

    prepare(weight [out, in], bias) -> LinearState(weight: float8_e4m3fn [out, in] (a view of the padded
        [out16, in16] tensor kept in extras["padded"]), extras["scale"]: float32 [1, out16])
    apply(state, x [..., in]) -> [..., out]: x quantized per token (quantize_rows), then the GEMM
    apply_quantized(state, QuantizedRows) -> [..., out]: an input a fused kernel already quantized
        (mmenc.backends.kernels.fused_rows: the norm or activation producing it, no pass of its own)

The bias is added in the GEMM's epilogue (`_scaled_mm(bias=)`, padded like the rows) where the device's
`_scaled_mm` takes one with row-wise scales (tried once per device), else after it.
`_scaled_mm` needs both weight dims divisible by 16: a weight is padded with zero rows/columns at load
(Qwen2.5-VL's 3420-wide MLP: 3424 columns; the merged 6840-row gate/up: 6848 rows) and the output sliced.
Accuracy and speed: docs/linear.md, "FP8". On the CPU (tests) `_scaled_mm` runs torch's reference kernel.
"""
import functools
import logging
import math
from typing import NamedTuple

import torch

from mmenc.backends.linear.base import LinearBackend, LinearState, dtype_name
from mmenc.backends.linear.enum import LinearBackendEnum

logger = logging.getLogger(__name__)  # under the package's "mmenc" logger

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12 / FP8_MAX  # an all-zero row keeps a finite scale
FP8_QUANTIZATIONS = ("fp8", "fp8-all")


class QuantizedRows(NamedTuple):
    """An activation already in FP8: data float8_e4m3fn [..., width] (columns past the features zero),
    scale float32 [..., 1] (value = data * scale)."""

    data: torch.Tensor
    scale: torch.Tensor


def padded(n: int) -> int:
    """n rounded up to the multiple of 16 `_scaled_mm` needs."""
    return math.ceil(n / 16) * 16


def quantize_rows(x: torch.Tensor, width: int | None = None) -> QuantizedRows:
    """x [..., n] -> QuantizedRows with per-row scales amax / 448, `width` >= n columns (zero padded).
    Plain torch: under torch.compile it fuses into the kernel producing x."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / FP8_MAX
    if width is not None and width > x.shape[-1]:
        xf = torch.nn.functional.pad(xf, (0, width - x.shape[-1]))  # zero columns quantize to zero
    return QuantizedRows((xf / scale).to(FP8_DTYPE), scale)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (float8_e4m3fn [padded(out), padded(in)], float32 scale [padded(out)]) with
    per-output-channel scales amax / 448; padding rows and columns are zero (scale 1)."""
    out, inp = weight.shape
    wf = weight.detach().float()
    scale = wf.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    q = torch.zeros(padded(out), padded(inp), device=weight.device, dtype=FP8_DTYPE)
    q[:out, :inp] = (wf / scale[:, None]).to(FP8_DTYPE)
    full = torch.ones(padded(out), device=weight.device, dtype=torch.float32)
    full[:out] = scale
    return q, full


class Fp8Linear(LinearBackend):
    enum = LinearBackendEnum.FP8
    not_batch_invariant = None  # per-token scales: a row's quantization depends on that row alone
    takes_quantized_input = True
    defers_bias = True

    @classmethod
    def is_installed(cls) -> bool:
        return hasattr(torch, "float8_e4m3fn") and hasattr(torch, "_scaled_mm")

    @classmethod
    def _reasons(cls, device, dtype, quantization):
        reasons = []
        if not cls.is_installed():
            reasons.append(f"this torch {torch.__version__} has no float8_e4m3fn / torch._scaled_mm")
        if device.type != "cuda":
            reasons.append(f"needs a CUDA GPU with FP8 tensor cores (sm89+), this is {device.describe()}")
        elif (device.capability or (0, 0)) < (8, 9):
            reasons.append(f"needs compute capability 8.9+ (Ada, Hopper) for FP8 GEMMs, this is "
                           f"{device.describe()}")
        if dtype != torch.bfloat16:
            reasons.append(f"outputs bfloat16 (row-wise scaled FP8 GEMMs); the tower's dtype is {dtype_name(dtype)}")
        if quantization not in FP8_QUANTIZATIONS:
            reasons.append(f"runs quantization='fp8' or 'fp8-all' only (quantization={quantization!r})")
        return reasons

    @classmethod
    def prepare(cls, weight, bias):
        q, scale = quantize_weight(weight)
        out, inp = weight.shape
        extras = {"padded": q, "scale": scale.view(1, -1)}
        if bias is not None and gemm_adds_bias(weight.device):  # the GEMM's epilogue adds it: [padded(out)]
            extras["bias"] = torch.zeros(q.shape[0], device=bias.device, dtype=weight.dtype)
            extras["bias"][:out] = bias
        return LinearState(q[:out, :inp], bias, extras, out_dtype=weight.dtype)

    @classmethod
    def input_width(cls, state: LinearState) -> int:
        """Columns a pre-quantized input must have (the padded K)."""
        return state.extras["padded"].shape[1]

    @classmethod
    def apply(cls, state, x):
        return cls.apply_quantized(state, quantize_rows(x, cls.input_width(state)))

    @classmethod
    def apply_unbiased(cls, state, x):
        if not isinstance(x, QuantizedRows):
            x = quantize_rows(x, cls.input_width(state))
        return cls.apply_quantized(state, x, add_bias=False)

    @classmethod
    def apply_quantized(cls, state: LinearState, x: QuantizedRows, add_bias: bool = True) -> torch.Tensor:
        q = state.extras["padded"]
        lead, out = x.data.shape[:-1], state.weight.shape[0]
        if x.data.shape[-1] != q.shape[1]:
            raise ValueError(f"FP8 input has {x.data.shape[-1]} columns; expected {q.shape[1]} (the padded "
                             f"in_features)")
        fused_bias = state.extras.get("bias") if add_bias else None
        y = torch._scaled_mm(x.data.reshape(-1, q.shape[1]), q.t(), scale_a=x.scale.reshape(-1, 1),
                             scale_b=state.extras["scale"], bias=fused_bias, out_dtype=state.out_dtype)
        y = y[:, :out] if q.shape[0] != out else y
        if state.bias is not None and add_bias and fused_bias is None:
            y = y + state.bias
        return y.view(*lead, out) if y.is_contiguous() else y.unflatten(0, lead)

    @classmethod
    def restore(cls, state):
        out, inp = state.weight.shape
        scale = state.extras["scale"].view(-1)[:out, None]
        return (state.weight.float() * scale).to(state.out_dtype)

    @classmethod
    def state_nbytes(cls, state):
        bias = state.bias.nbytes if state.bias is not None else 0
        return sum(t.nbytes for t in state.extras.values()) + bias


@functools.cache
def _gemm_adds_bias(device_type: str, index: int | None) -> bool:
    """Whether this device's row-wise scaled `_scaled_mm` takes a bfloat16 bias (its epilogue adds it), tried
    once on a 16 x 16 x 16 product; where it refuses, the bias is added after the GEMM."""
    device = torch.device(device_type, index) if index is not None else torch.device(device_type)
    a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
    one = torch.ones(16, 1, device=device)
    try:
        y = torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16,
                             bias=torch.ones(16, device=device, dtype=torch.bfloat16))
    except RuntimeError as e:
        logger.info("torch._scaled_mm on %s takes no bias with row-wise scales (%s); FP8 linears add theirs after "
                    "the GEMM", device, str(e).splitlines()[0])
        return False
    return bool((y.float() == 17.0).all())


def gemm_adds_bias(device: torch.device) -> bool:
    return _gemm_adds_bias(device.type, device.index)
