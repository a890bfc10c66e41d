"""The encoder-attention call as one torch custom op, so compiled towers treat it as opaque.

    mm_encoder_attention(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1],
                         max_seqlen, scale, backend, short_backend, short_seqlen_max) -> [T, Hq, D]

`backend` / `short_backend` are AttentionBackendEnum names (short_backend "" when the layer has no
per-shape choice); the pack runs on `short_backend` when max_seqlen <= short_seqlen_max. The real
implementation runs eagerly (pack lookups, backend dispatch); the fake one only gives the shape, so
torch.compile traces a block around it without graph breaks.
"""
import torch

from mmenc.attention.backend_enum import AttentionBackendEnum
from mmenc.attention.backends import get_backend_class
from mmenc.attention.packing import pack_info


@torch.library.custom_op("mmenc::mm_encoder_attention", mutates_args=())
def mm_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float, backend: str, short_backend: str,
                         short_seqlen_max: int) -> torch.Tensor:
    info = pack_info(cu_seqlens, q.shape[0])  # host view: cached, no device read for make_cu_seqlens packs
    if max_seqlen != info.max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} but the longest segment of cu_seqlens has {info.max_seqlen} "
                         f"tokens; pass the pack's own max_seqlen (make_cu_seqlens returns it)")
    name = short_backend if short_backend and max_seqlen <= short_seqlen_max else backend
    out = get_backend_class(AttentionBackendEnum[name]).forward(q, k, v, cu_seqlens, max_seqlen, scale)
    return out.contiguous() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out


@mm_encoder_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, backend, short_backend, short_seqlen_max):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
