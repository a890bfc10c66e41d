"""ROCM_AITER_FA: AMD aiter's varlen FlashAttention (`aiter.flash_attn_varlen_func`, CK kernels).

For the MI200/MI300/MI350 family (gfx90a, gfx942, gfx950). Takes the packed layout as is: q [T, Hq, D],
k/v [T, Hkv, D] (GQA native), int32 cu_seqlens and max_seqlen.
"""
import functools

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend, collect, need_device, need_half, need_head_size
from mmenc.backends.packing import pack_info

ARCHS = ("gfx90a", "gfx942", "gfx950")


@functools.cache
def _varlen_func():
    from aiter import flash_attn_varlen_func

    return flash_attn_varlen_func


class AiterBackend(AttentionBackend):
    enum = AttentionBackendEnum.ROCM_AITER_FA
    requires = ("aiter", "amd-aiter")

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        reasons = collect(need_device(device, "cuda"))
        if not reasons and (not device.is_rocm or device.arch not in ARCHS):
            reasons.append(f"needs an AMD GPU of arch {', '.join(ARCHS)}, this is {device.describe()}")
        return reasons + collect(need_half(dtype), need_head_size(head_size, 8, 256))

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        pack_info(cu_seqlens, q.shape[0])  # validates the pack (cached host view)
        cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
        out = _varlen_func()(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_seqlen,
                             max_seqlen_k=max_seqlen, softmax_scale=scale, causal=False)
        return out[0] if isinstance(out, tuple) else out  # (out, lse, ...) when asked for extras
