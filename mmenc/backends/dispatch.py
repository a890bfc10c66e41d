"""The encoder-attention call as one torch custom op, so compiled towers treat it as opaque.

    attend(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1], max_seqlen, scale,
           choice: BackendChoice) -> [T, Hq, D]

The op `mmenc::mm_encoder_attention` takes the choice as plain values (backend names, the
short-segment bound, batch invariance) and applies it here, per segment: a pack whose segments are
all of one length class runs its class's backend over the whole pack; a pack with both classes is
split into its short and long sub-packs (index tensors made once per pack, host side, cached with
the pack), each run by its own backend and written back; in batch-invariant mode every pack runs as
fixed-shape sub-packs of equal-length segments (mmenc.backends.packing.sub_packs), except for a
class whose backend is shape-independent (TRITON_ATTN's fixed-config path), which runs at once
through `forward_batch_invariant`. No host sync.
The real implementation runs eagerly; the fake one only gives the shape, so torch.compile traces a
block around it without graph breaks.
"""
import functools

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.choice import BackendChoice
from mmenc.backends.packing import pack_info, sub_packs
from mmenc.backends.registry import get_backend_class


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
           scale: float, choice: BackendChoice) -> torch.Tensor:
    """Attention over the pack, each segment by the backend `choice` gives its length; q's shape out."""
    short = choice.short.name if choice.short is not None else ""
    return mm_encoder_attention(q, k, v, cu_seqlens, max_seqlen, scale, choice.main.name, short,
                                choice.short_seqlen_max, choice.batch_invariant)


@torch.library.custom_op("mmenc::mm_encoder_attention", mutates_args=())
def mm_encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         max_seqlen: int, scale: float, backend: str, short_backend: str,
                         short_seqlen_max: int, batch_invariant: bool) -> torch.Tensor:
    info = pack_info(cu_seqlens, q.shape[0])  # host view: cached, no device read for make_cu_seqlens packs
    if max_seqlen != info.max_seqlen:
        raise ValueError(f"max_seqlen={max_seqlen} but the longest segment of cu_seqlens has {info.max_seqlen} "
                         f"tokens; pass the pack's own max_seqlen (make_cu_seqlens returns it)")
    choice = _choice(backend, short_backend, short_seqlen_max, batch_invariant)
    short_max = choice.short_seqlen_max if choice.short is not None else None
    whole = frozenset(short for short, enum in ((True, choice.short or choice.main), (False, choice.main))
                      if batch_invariant and get_backend_class(enum).shape_independent)
    plan = sub_packs(info, short_max, batch_invariant, q.device, whole)
    if plan is not None and len(plan) == 1 and isinstance(plan[0].rows, slice) and plan[0].rows == slice(0, q.shape[0]):
        plan = None  # one class run whole (shape-independent backend, batch-invariant mode): no copies
    if plan is None:  # the whole pack at once
        cls = get_backend_class(choice.backend_for(info.min_seqlen))
        run = cls.forward_batch_invariant if batch_invariant else cls.forward
        out = run(q, k, v, cu_seqlens, max_seqlen, scale)
        return out.contiguous() if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()) else out
    out = q.new_empty(q.shape)
    for sub in plan:
        cls = get_backend_class(choice.short if sub.short else choice.main)
        run = cls.forward_batch_invariant if batch_invariant else cls.forward
        if isinstance(sub.rows, slice):  # [t, H, D] views of the pack
            res = run(q[sub.rows], k[sub.rows], v[sub.rows], sub.cu_seqlens, sub.max_seqlen, scale)
            out[sub.dest] = res
        else:  # gathered rows (fresh, contiguous buffers)
            qs, ks, vs = (x.index_select(0, sub.rows) for x in (q, k, v))
            res = run(qs, ks, vs, sub.cu_seqlens, sub.max_seqlen, scale)
            n = sub.dest.shape[0]
            out.index_copy_(0, sub.dest, res[:n] if n != res.shape[0] else res)
    return out


@functools.lru_cache(maxsize=64)
def _choice(backend: str, short_backend: str, short_seqlen_max: int, batch_invariant: bool) -> BackendChoice:
    """The op's plain arguments as the BackendChoice they came from (made once per combination)."""
    short = AttentionBackendEnum[short_backend] if short_backend else None
    return BackendChoice(AttentionBackendEnum[backend], short, short_seqlen_max, batch_invariant)


@mm_encoder_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale, backend, short_backend, short_seqlen_max, batch_invariant):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
