"""The encoder-attention call as one torch custom op, so compiled towers treat it as opaque.

    attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1], max_seqlen, scale,
           choice: BackendChoice) -> [T, Hq, D]

The op `mmenc::mm_encoder_attention` takes the choice as plain values (backend names and the
short-segment bound) and applies it here, per pack, from max_seqlen. The real implementation runs
eagerly (pack lookup, backend dispatch); the fake one only gives the shape, so torch.compile traces
a block around it without graph breaks.
"""
import functools

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.choice import BackendChoice
from mmenc.backends.packing import pack_info
from mmenc.backends.registry import get_backend_class


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float, choice: BackendChoice) -> torch.Tensor:
    """Attention over the pack with the backend `choice` gives for its max_seqlen; q's shape out."""
    short = choice.short.name if choice.short is not None else ""
    return mm_encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale, choice.main.name, short,
                                choice.short_seqlen_max)


@torch.library.custom_op("mmenc::mm_encoder_attention", mutates_args=())
def mm_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float, backend: str, short_backend: str,
                         short_seqlen_max: int) -> torch.Tensor:
    info = pack_info(cu_seqlens, q.shape[0])  # host view: cached, no device read for make_cu_seqlens packs
    if max_seqlen != info.max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} but the longest segment of cu_seqlens has {info.max_seqlen} "
                         f"tokens; pass the pack's own max_seqlen (make_cu_seqlens returns it)")
    choice = _choice(backend, short_backend, short_seqlen_max)
    out = get_backend_class(choice.backend_for(max_seqlen)).forward(q, k, v, cu_seqlens, max_seqlen, scale)
    return out.contiguous() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out


@functools.lru_cache(maxsize=64)
def _choice(backend: str, short_backend: str, short_seqlen_max: int) -> BackendChoice:
    """The op's plain arguments as the BackendChoice they came from (made once per combination)."""
    short = AttentionBackendEnum[short_backend] if short_backend else None
    return BackendChoice(AttentionBackendEnum[backend], short, short_seqlen_max)


@mm_encoder_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, backend, short_backend, short_seqlen_max):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
