"""Platform: the one place that chooses an encoder-attention backend, and explains the choice."""
import dataclasses
from typing import ClassVar

import torch

from mmenc.backends import (SHORT_SEQLEN_MAX, AttentionBackendEnum, BackendChoice, DeviceInfo, get_backend_class,
                            registered_backends)
from mmenc.logger import init_logger, log_once

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class BackendReport:
    """One row of `explain_vit_attn_backends`: could `backend` run, and why not."""

    backend: AttentionBackendEnum
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
        if backend is not None:
            backend = AttentionBackendEnum.from_name(backend)
            reasons = self.backend_reasons(backend, head_size, dtype, batch_invariant)
            if reasons:
                usable = [b.name for b in self._usable(head_size, dtype, batch_invariant)]
                raise ValueError(
                    f"attention backend {backend.name} cannot run head_size={head_size}, "
                    f"dtype={_dtype_name(dtype)}{_mode(batch_invariant)} on {self.device_info().describe()}: "
                    f"{'; '.join(reasons)}. "
                    f"Usable here: {', '.join(usable) or 'none'}")
            log_once(logger, f"encoder attention: {backend.name} (requested) for head_size={head_size}, "
                             f"dtype={_dtype_name(dtype)}")
            return backend
        rejected = []
        for candidate in self.vit_attn_priority(dtype):
            reasons = self.backend_reasons(candidate, head_size, dtype, batch_invariant)
            if not reasons:
                why = f"first usable in the {self.name} priority list"
                if rejected:
                    why += " (" + "; ".join(rejected) + ")"
                log_once(logger, f"encoder attention: {candidate.name} for head_size={head_size}, "
                                 f"dtype={_dtype_name(dtype)}: {why}")
                return candidate
            rejected.append(f"{candidate.name}: {', '.join(reasons)}")
        raise ValueError(f"no encoder-attention backend can run head_size={head_size}, dtype={_dtype_name(dtype)}"
                         f"{_mode(batch_invariant)} on {self.device_info().describe()}: " + "; ".join(rejected))

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

    def _usable(self, head_size: int, dtype: torch.dtype, batch_invariant: bool = False) -> list[AttentionBackendEnum]:
        return [b for b in self.vit_attn_priority(dtype)
                if not self.backend_reasons(b, head_size, dtype, batch_invariant)]

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


def _mode(batch_invariant: bool) -> str:
    return " batch-invariantly" if batch_invariant else ""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
