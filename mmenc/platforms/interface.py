"""Platform: the one place that chooses an encoder-attention backend, and explains the choice."""
import dataclasses
from typing import ClassVar

import torch

from mmenc.backends import (SHORT_SEQLEN_MAX, AttentionBackendEnum, BackendChoice, DeviceInfo, get_backend_class,
                            registered_backends)
from mmenc.backends.linear import (QUANTIZATIONS, LinearBackendEnum, get_linear_backend_class,
                                   registered_linear_backends)
from mmenc.logger import init_logger, log_once

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class BackendReport:
    """One row of `explain_vit_attn_backends` (or `explain_linear_backends`): could `backend` run, and why not."""

    backend: AttentionBackendEnum | LinearBackendEnum
    installed: bool
    version: str | None
    reasons: tuple[str, ...]
    in_priority: bool

    @property
    def usable(self) -> bool:
        return not self.reasons


class Platform:
    name: ClassVar[str] = "unknown"
    device_type: ClassVar[str] = "cpu"
    # Which CustomOp.forward_<key> runs on this platform.
    custom_op_key: ClassVar[str] = "native"

    def __init__(self, device_info: DeviceInfo | None = None):
        """`device_info` overrides what is read from the hardware (tests simulate devices with it)."""
        self._device_info = device_info

    def device_info(self) -> DeviceInfo:
        if self._device_info is None:
            self._device_info = self._detect_device_info()
        return self._device_info

    def _detect_device_info(self) -> DeviceInfo:
        return DeviceInfo(type=self.device_type, vendor=self.name)

    def vit_attn_priority(self, dtype: torch.dtype) -> list[AttentionBackendEnum]:
        """This platform's encoder-attention backends, best first."""
        raise NotImplementedError

    # Segments up to this many tokens count as "short" (Qwen2.5-VL's windows: 64).
    short_seqlen_max: ClassVar[int] = SHORT_SEQLEN_MAX

    def vit_attn_short_priority(self, dtype: torch.dtype) -> list[AttentionBackendEnum]:
        """Backends preferred for short segments (<= short_seqlen_max tokens), best first; empty: no
        per-shape choice (the main backend runs every segment)."""
        return []

    def get_supported_vit_attn_backends(self) -> list[AttentionBackendEnum]:
        """Every backend this platform may select, best first (for any dtype)."""
        seen: list[AttentionBackendEnum] = []
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            seen += [b for b in self.vit_attn_priority(dtype) + self.vit_attn_short_priority(dtype) if b not in seen]
        return seen

    def backend_reasons(self, backend: AttentionBackendEnum, head_size: int, dtype: torch.dtype,
                        batch_invariant: bool = False) -> list[str]:
        """Why `backend` cannot run here (batch-invariantly, when asked); empty: it can."""
        reasons = []
        if backend not in self.get_supported_vit_attn_backends():
            reasons.append(f"not offered by the {self.name} platform")
        if backend not in registered_backends():  # a priority list may name a backend this build lacks
            return reasons + ["not registered in this build of mmenc"]
        cls = get_backend_class(backend)
        if batch_invariant:  # passed only when asked: a plugin's backend may override the 3-argument form
            return reasons + cls.unsupported_reasons(head_size, dtype, self.device_info(), batch_invariant=True)
        return reasons + cls.unsupported_reasons(head_size, dtype, self.device_info())

    def get_vit_attn_backend(self, head_size: int, dtype: torch.dtype,
                             backend: AttentionBackendEnum | str | None = None,
                             batch_invariant: bool = False) -> AttentionBackendEnum:
        """The backend for (head_size, dtype) here. An explicit `backend` is checked and returned
        or rejected with ValueError; it is never replaced by another. `batch_invariant`: only
        backends that can give batch-invariant results (AttentionBackend.not_batch_invariant)."""
        requested = AttentionBackendEnum.from_name(backend) if backend is not None else None
        return self._select("attention", "encoder-attention", "encoder attention", requested,
                            self.vit_attn_priority(dtype),
                            lambda b: self.backend_reasons(b, head_size, dtype, batch_invariant),
                            f"head_size={head_size}, dtype={_dtype_name(dtype)}", batch_invariant)

    def _select(self, kind: str, none_kind: str, log_prefix: str, requested, priority: list,
                reasons_of, what: str, batch_invariant: bool):
        """The one selection loop (attention and linear backends): `requested` checked and returned or
        rejected with ValueError naming its reasons and the usable alternatives; else the first of
        `priority` without reasons; else ValueError listing every candidate's reasons."""
        where = f"{_mode(batch_invariant)} on {self.device_info().describe()}"
        if requested is not None:
            reasons = reasons_of(requested)
            if reasons:
                usable = [b.name for b in priority if not reasons_of(b)]
                raise ValueError(f"{kind} backend {requested.name} cannot run {what}{where}: {'; '.join(reasons)}. "
                                 f"Usable here: {', '.join(usable) or 'none'}")
            log_once(logger, f"{log_prefix}: {requested.name} (requested) for {what}")
            return requested
        rejected = []
        for candidate in priority:
            reasons = reasons_of(candidate)
            if not reasons:
                why = f"first usable in the {self.name} priority list"
                if rejected:
                    why += " (" + "; ".join(rejected) + ")"
                log_once(logger, f"{log_prefix}: {candidate.name} for {what}: {why}")
                return candidate
            rejected.append(f"{candidate.name}: {', '.join(reasons)}")
        raise ValueError(f"no {none_kind} backend can run {what}{where}: " + "; ".join(rejected))

    def choose_vit_attn(self, head_size: int, dtype: torch.dtype, backend: AttentionBackendEnum | str | None = None,
                        batch_invariant: bool = False) -> BackendChoice:
        """The whole choice for (head_size, dtype) here: the main backend and, for automatic
        selection only, the one for short segments (an explicit backend runs every segment).
        `batch_invariant`: both from the backends that can give batch-invariant results."""
        main = self.get_vit_attn_backend(head_size, dtype, backend, batch_invariant)
        short = self.get_vit_attn_short_backend(head_size, dtype, main, batch_invariant) if backend is None else None
        return BackendChoice(main, short, self.short_seqlen_max, batch_invariant)

    def get_vit_attn_short_backend(self, head_size: int, dtype: torch.dtype, main: AttentionBackendEnum,
                                   batch_invariant: bool = False) -> AttentionBackendEnum | None:
        """The backend for segments of <= short_seqlen_max tokens, when it differs from `main` (the
        per-shape choice); None when `main` runs every segment. Only for automatic selection: an
        explicit backend runs everywhere."""
        for candidate in self.vit_attn_short_priority(dtype):
            if not self.backend_reasons(candidate, head_size, dtype, batch_invariant):
                if candidate == main:
                    return None
                log_once(logger, f"encoder attention: {candidate.name} for segments of <= {self.short_seqlen_max} "
                                 f"tokens (head_size={head_size}, dtype={_dtype_name(dtype)}), {main.name} for longer")
                return candidate
        return None

    def explain_vit_attn_backends(self, head_size: int, dtype: torch.dtype,
                                  batch_invariant: bool = False) -> list[BackendReport]:
        """A report for every registered backend: installed, version, reasons it cannot run here."""
        offered = self.get_supported_vit_attn_backends()
        rows = []
        for backend in registered_backends():
            cls = get_backend_class(backend)
            rows.append(BackendReport(backend, cls.is_installed(), cls.version() if cls.is_installed() else None,
                                      tuple(self.backend_reasons(backend, head_size, dtype, batch_invariant)),
                                      backend in offered))
        return rows

    # -- the host process ---------------------------------------------------------------------------

    def prepare_host(self, cpu_malloc: str = "tuned") -> str | None:
        """Process-wide tuning for a tower on this platform's device, done once when an Encoder puts one
        there; returns what was done (for the log), None for nothing. Accelerators: nothing."""
        return None

    def compiles_elementwise(self) -> bool:
        """Whether towers on this platform's device run RMSNorm and QuickGELU through Inductor-compiled
        kernels (mmenc.layers.compiled_kernels), where torch's eager forms are chains of unfused ops.
        Accelerators: no."""
        return False

    # -- fused row kernels (mmenc.layers.fused) ---------------------------------------------------

    def fused_kernel_reasons(self, dtype: torch.dtype) -> list[str]:
        """Why the fused row kernels (residual add + norm, gated activation, FP8 quantization inside them)
        cannot run `dtype` towers here; empty: they can. A platform with kernels of its own overrides it."""
        return [f"the {self.name} platform has no fused row kernels"]

    # -- linear backends: the same selection loop ------------------------------------------------

    def linear_priority(self, dtype: torch.dtype, quantization: str | None = None) -> list[LinearBackendEnum]:
        """This platform's linear backends for `dtype` weights (quantized as `quantization`), best first."""
        return [LinearBackendEnum.NATIVE]

    def get_supported_linear_backends(self) -> list[LinearBackendEnum]:
        """Every linear backend this platform may select (any dtype or quantization), best first."""
        seen: list[LinearBackendEnum] = []
        for quantization in (None, *QUANTIZATIONS):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                seen += [b for b in self.linear_priority(dtype, quantization) if b not in seen]
        return seen

    def linear_backend_reasons(self, backend: LinearBackendEnum, dtype: torch.dtype, quantization: str | None = None,
                               batch_invariant: bool = False) -> list[str]:
        """Why `backend` cannot run `dtype` linears (quantized as `quantization`) here; empty: it can."""
        reasons = [] if backend in self.get_supported_linear_backends() else [f"not offered by the {self.name} platform"]
        if backend not in registered_linear_backends():
            return reasons + ["not registered in this build of mmenc"]
        cls = get_linear_backend_class(backend)
        return reasons + cls.reasons(self.device_info(), dtype, quantization, batch_invariant)

    def get_linear_backend(self, dtype: torch.dtype, quantization: str | None = None,
                           backend: LinearBackendEnum | str | None = None,
                           batch_invariant: bool = False) -> LinearBackendEnum:
        """The linear backend for `dtype` weights here; an explicit `backend` is checked and returned or
        rejected with ValueError (never replaced). `batch_invariant`: only backends that can give
        batch-invariant results (LinearBackend.not_batch_invariant)."""
        requested = LinearBackendEnum.from_name(backend) if backend is not None else None
        what = f"dtype={_dtype_name(dtype)}" + (f", quantization={quantization}" if quantization else "")
        return self._select("linear", "linear", "linears", requested, self.linear_priority(dtype, quantization),
                            lambda b: self.linear_backend_reasons(b, dtype, quantization, batch_invariant), what,
                            batch_invariant)

    def explain_linear_backends(self, dtype: torch.dtype, quantization: str | None = None,
                                batch_invariant: bool = False) -> list[BackendReport]:
        """A report for every registered linear backend: installed, reasons it cannot run here."""
        offered = self.get_supported_linear_backends()
        rows = []
        for backend in registered_linear_backends():
            cls = get_linear_backend_class(backend)
            rows.append(BackendReport(backend, cls.is_installed(), torch.__version__ if cls.is_installed() else None,
                                      tuple(self.linear_backend_reasons(backend, dtype, quantization, batch_invariant)),
                                      backend in offered))
        return rows


def _mode(batch_invariant: bool) -> str:
    return " batch-invariantly" if batch_invariant else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")

