"""FLASH_ATTN: the FlashAttention family, the best one installed that can run the request.

FA4 (`flash_attn.cute`, pip flash-attn-4; Hopper and Blackwell), FA3 (`flash_attn_interface`,
pip flash-attn-3; Hopper), FA2 (`flash_attn`, pip flash-attn; Ampere+ and AMD gfx9 builds).
Each gets q [T, Hq, D], k/v [T, Hkv, D] (GQA native), int32 cu_seqlens and max_seqlen as they are.
"""
import functools
import importlib
import importlib.metadata
import importlib.util
import os

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import (AttentionBackend, collect, need_device, need_half, need_head_size,
                                 need_nvidia_capability)
from mmenc.backends.device import DeviceInfo, probe_device
from mmenc.backends.packing import pack_info

_AMD_ARCHS = ("gfx90a", "gfx942", "gfx950")


def _fa4_reasons(head_size, device):
    if not device.is_nvidia or device.capability is None or device.capability[0] not in (9, 10, 11):
        return [f"needs an NVIDIA Hopper (9.x) or Blackwell (10.x/11.x) GPU, this is {device.describe()}"]
    if device.capability[0] in (10, 11) and 128 < head_size != 256:
        return [f"head_size {head_size} is not supported on Blackwell (8..128 in steps of 8, or 256)"]
    return collect(need_head_size(head_size, 8, 256))


def _fa3_reasons(head_size, device):
    if not device.is_nvidia or device.capability is None or device.capability[0] != 9:
        return [f"needs an NVIDIA Hopper GPU (compute capability 9.x), this is {device.describe()}"]
    return collect(need_head_size(head_size, 8, 256))


def _fa2_reasons(head_size, device):
    if device.is_rocm:
        arch_ok = device.arch in _AMD_ARCHS
        reasons = [] if arch_ok else [f"needs an AMD GPU of {'/'.join(_AMD_ARCHS)}, this is {device.describe()}"]
    else:
        reasons = collect(need_nvidia_capability(device, 8, 0))
    return reasons + collect(need_head_size(head_size, 8, 256))


def _has(top: str, relpath: str | None = None) -> bool:
    """Whether `top` is importable (and holds `relpath`), without importing it."""
    spec = importlib.util.find_spec(top)
    if spec is None or relpath is None:
        return spec is not None
    return any(os.path.exists(os.path.join(loc, relpath)) for loc in spec.submodule_search_locations or ())


# (name, module holding flash_attn_varlen_func, pip distribution, installed?, reasons), best first.
_IMPLS = (
    ("fa4", "flash_attn.cute", "flash-attn-4", lambda: _has("flash_attn", "cute/interface.py"), _fa4_reasons),
    ("fa3", "flash_attn_interface", "flash-attn-3", lambda: _has("flash_attn_interface"), _fa3_reasons),
    ("fa2", "flash_attn", "flash-attn", lambda: _has("flash_attn", "flash_attn_interface.py"), _fa2_reasons),
)


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


class FlashAttnBackend(AttentionBackend):
    enum = AttentionBackendEnum.FLASH_ATTN
    not_batch_invariant = None  # per segment, position-independent; fixed shapes per sub-pack
    requires = ("flash_attn", "flash-attn-4")
    install_hint = "pip install --pre 'flash-attn-4[cu13]' for torch cu13 builds, --pre flash-attn-4 for cu12; pre-release only"

    @classmethod
    def is_installed(cls) -> bool:
        return any(installed() for _, _, _, installed, _ in _IMPLS)

    @classmethod
    def version(cls) -> str | None:
        found = [f"{name} {_dist_version(dist)}" for name, _, dist, installed, _ in _IMPLS if installed()]
        return ", ".join(found) or None

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        base = collect(need_device(device, "cuda"), need_half(dtype))
        if base or not cls.is_installed():
            return base
        _, why = cls.implementation(head_size, dtype, device)
        return why

    @classmethod
    @functools.cache
    def implementation(cls, head_size: int, dtype: torch.dtype, device: DeviceInfo) -> tuple[str | None, list[str]]:
        """(name of the implementation to use, or None; why each installed one cannot run)."""
        why = []
        for name, _, dist, installed, reasons in _IMPLS:
            if installed():
                r = reasons(head_size, device)
                if not r:
                    return name, []
                why.append(f"{name} {_dist_version(dist)}: {'; '.join(r)}")
        return None, why

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        pack_info(cu_seqlens, q.shape[0])  # validates the pack (cached host view)
        name, why = cls.implementation(q.shape[-1], q.dtype, probe_device(q.device))
        if name is None:
            raise RuntimeError(f"FLASH_ATTN cannot run head_size={q.shape[-1]}, {q.dtype}: {'; '.join(why)}")
        cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        out = _varlen_func(name)(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                                 max_seqlen_k=max_seqlen, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out  # FA4 (and some FA3 builds) return (out, lse)


@functools.cache
def _varlen_func(name: str):
    module = next(m for n, m, _, _, _ in _IMPLS if n == name)
    return importlib.import_module(module).flash_attn_varlen_func
