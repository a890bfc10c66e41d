"""XFORMERS: `xformers.ops.memory_efficient_attention` with a BlockDiagonalMask over the segments.

The one packed path on pre-Ampere NVIDIA GPUs, and one that takes float32. The mask is built once
per pack from the host view of `cu_seqlens` (no device read) and kept in `pack_info(...).cache`.
GQA goes through xformers' 5-D [B, M, G, H, K] layout with the KV heads broadcast, not copied.
"""
import functools
import inspect

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend, collect, need_device
from mmenc.backends.packing import pack_info


@functools.cache
def _xops():
    import xformers.ops as xops

    takes_device = "device" in inspect.signature(xops.fmha.attn_bias.BlockDiagonalMask.from_seqlens).parameters
    return xops, takes_device


def block_diagonal_mask(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device):
    info = pack_info(cu_seqlens, num_tokens)
    key = ("xformers_mask", device)
    if key not in info.cache:
        xops, takes_device = _xops()
        lengths = [n for n in info.lengths if n > 0]  # empty segments hold no tokens
        kwargs = {"device": device} if takes_device else {}
        info.cache[key] = xops.fmha.attn_bias.BlockDiagonalMask.from_seqlens(lengths, **kwargs)
    return info.cache[key]


class XFormersBackend(AttentionBackend):
    enum = AttentionBackendEnum.XFORMERS
    requires = ("xformers", "xformers")

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        reasons = collect(need_device(device, "cuda"))
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"{str(dtype).removeprefix('torch.')} is not supported (float16, bfloat16 or float32)")
        if device.is_nvidia and device.capability is not None:
            if device.capability < (6, 0):
                reasons.append(f"needs CUDA compute capability >= 6.0, this is {device.describe()}")
            elif dtype == torch.bfloat16 and device.capability < (8, 0):
                reasons.append(f"bfloat16 needs compute capability >= 8.0, this is {device.describe()}")
        return reasons

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        t, hq, d = q.shape
        hkv = k.shape[1]
        xops, _ = _xops()
        mask = block_diagonal_mask(cu_seqlens, t, q.device)
        if hq == hkv:  # [T, H, D] -> [1, T, H, D]
            out = xops.memory_efficient_attention(q[None], k[None], v[None], attn_bias=mask, scale=scale)
            return out[0]
        g = hq // hkv  # [T, Hq, D] -> [1, T, Hkv, g, D]; k, v broadcast over g
        q5 = q.reshape(1, t, hkv, g, d)
        k5, v5 = (x.reshape(1, t, hkv, 1, d).expand(1, t, hkv, g, d) for x in (k, v))
        out = xops.memory_efficient_attention(q5, k5, v5, attn_bias=mask, scale=scale)
        return out.reshape(t, hq, d)
