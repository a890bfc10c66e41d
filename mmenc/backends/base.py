"""The contract every encoder-attention backend follows.

forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1], max_seqlen int,
scale float) -> out [T, Hq, D]: non-causal attention confined to each segment of the pack.
`Hq % Hkv == 0` (GQA/MQA); q, k, v share dtype and device; output is q's dtype.
"""
import importlib.metadata
import importlib.util
from typing import ClassVar

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.device import DeviceInfo


class AttentionBackend:
    enum: ClassVar[AttentionBackendEnum]
    # The optional Python distribution this backend needs (import name, distribution name).
    requires: ClassVar[tuple[str, str] | None] = None
    # How to install it, when a plain `pip install <distribution>` is not the way (pre-releases, extras).
    install_hint: ClassVar[str | None] = None
    # Why the backend cannot give batch-invariant results (MultiModalConfig(batch_invariant=True)),
    # or None where it can: run on fixed-shape sub-packs of equal-length segments (the dispatcher's
    # invariant mode), each segment's result must not depend on its offset or its neighbours.
    not_batch_invariant: ClassVar[str | None] = ("the backend does not declare it (a backend whose result for a "
                                                 "segment depends only on that segment sets "
                                                 "not_batch_invariant = None)")
    # In batch-invariant mode: True when `forward_batch_invariant`'s result for a segment depends only on
    # that segment (its rows and length), whatever the pack's size, offsets or other segments; the
    # dispatcher then runs a whole length class in one call instead of fixed-shape padded chunks.
    shape_independent: ClassVar[bool] = False

    @classmethod
    def is_installed(cls) -> bool:
        return cls.requires is None or importlib.util.find_spec(cls.requires[0]) is not None

    @classmethod
    def version(cls) -> str | None:
        """The version of the package behind the backend, or torch's when it needs none."""
        dist = cls.requires[1] if cls.requires else "torch"
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    @classmethod
    def unsupported_reasons(cls, head_size: int, dtype: torch.dtype, device: DeviceInfo,
                            batch_invariant: bool = False) -> list[str]:
        """Why this backend cannot run (head_size, dtype) on `device` (batch-invariantly, when asked);
        an empty list means it can."""
        reasons = []
        if not cls.is_installed():
            reasons.append(f"{cls.requires[0]} is not installed ({cls.install_hint or 'pip install ' + cls.requires[1]})")
        if batch_invariant and cls.not_batch_invariant:
            reasons.append(f"not batch invariant: {cls.not_batch_invariant}")
        return reasons + cls._reasons(head_size, dtype, device)

    @classmethod
    def _reasons(cls, head_size: int, dtype: torch.dtype, device: DeviceInfo) -> list[str]:
        return []

    @classmethod
    def forward(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                max_seqlen: int, scale: float) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def forward_batch_invariant(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                                max_seqlen: int, scale: float) -> torch.Tensor:
        """The dispatcher's call in batch-invariant mode (same contract as forward); forward unless the
        backend has a fixed-configuration path for that mode."""
        return cls.forward(q, k, v, cu_seqlens, max_seqlen, scale)


# Checks shared by several backends; each returns a reason or None.

def need_device(device: DeviceInfo, *types: str) -> str | None:
    if device.type not in types:
        return f"needs a {' or '.join(types)} device, this is {device.describe()}"
    return None


def need_nvidia_capability(device: DeviceInfo, major: int, minor: int = 0) -> str | None:
    if not device.is_nvidia:
        return f"needs an NVIDIA GPU, this is {device.describe()}"
    if device.capability is None or device.capability < (major, minor):
        return f"needs CUDA compute capability >= {major}.{minor}, this is {device.describe()}"
    return None


def need_half(dtype: torch.dtype) -> str | None:
    if dtype not in (torch.float16, torch.bfloat16):
        return f"{str(dtype).removeprefix('torch.')} is not supported (float16 or bfloat16 only)"
    return None


def need_head_size(head_size: int, multiple: int, maximum: int) -> str | None:
    if head_size % multiple:
        return f"head_size {head_size} is not a multiple of {multiple}"
    if head_size > maximum:
        return f"head_size {head_size} is larger than {maximum}"
    return None


def collect(*reasons: str | None) -> list[str]:
    return [r for r in reasons if r]
