"""TORCH_VARLEN: `torch.nn.attention.varlen.varlen_attn`, torch's own FlashAttention-2 varlen kernel.

One call over the whole pack. The keywords it takes changed across torch releases (`scale` and
`enable_gqa` are missing in some), so the signature is read once and what it lacks is done here:
a missing `scale` is folded into q, a missing `enable_gqa` expands the KV heads.
"""
import functools
import inspect
import math

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import (AttentionBackend, collect, need_device, need_half, need_head_size,
                                 need_nvidia_capability)
from mmenc.backends.packing import pack_info


@functools.cache
def _varlen():
    """(varlen_attn, the keyword names it accepts), or None where this torch has no varlen module."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


class TorchVarlenBackend(AttentionBackend):
    enum = AttentionBackendEnum.TORCH_VARLEN
    not_batch_invariant = None  # per segment, position-independent; fixed shapes per sub-pack

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        if _varlen() is None:
            return [f"torch {torch.__version__} has no torch.nn.attention.varlen (needs a newer torch)"]
        return collect(need_device(device, "cuda") or need_nvidia_capability(device, 8, 0), need_half(dtype),
                       need_head_size(head_size, 8, 256))

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        pack_info(cu_seqlens, q.shape[0])  # validates the pack (host view, no device read when cached)
        varlen_attn, params = _varlen()
        kwargs = {}
        if "scale" in params:
            kwargs["scale"] = scale
        elif not math.isclose(scale, q.shape[-1] ** -0.5):
            q = q * (scale * math.sqrt(q.shape[-1]))  # the kernel applies 1/sqrt(D) itself
        if q.shape[1] != k.shape[1]:
            if "enable_gqa" in params:
                kwargs["enable_gqa"] = True
            else:  # [T, Hkv, D] -> [T, Hq, D]
                groups = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cu = cu_seqlens.to(torch.int32)
        out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
        return out[0] if isinstance(out, tuple) else out
