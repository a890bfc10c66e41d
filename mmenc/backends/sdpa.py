"""TORCH_SDPA: torch's scaled_dot_product_attention, one batched call per distinct segment length.

Segments of equal length are gathered into one [n, H, L, D] batch (a view when they are adjacent),
so Qwen2.5-VL's hundreds of equal windows cost one kernel launch, not hundreds.
"""
import torch
import torch.nn.functional as F

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend
from mmenc.backends.packing import PackInfo, pack_info


def _group_plan(info: PackInfo, device: torch.device) -> list[tuple[int, int, object]]:
    """[(length, count, where)]: `where` is a token slice when the group's segments are adjacent,
    else an int64 index tensor of the group's tokens, segment-major."""
    key = ("sdpa_groups", device)
    if key not in info.cache:
        starts = info.starts()
        plan = []
        for length, segs in info.length_groups():
            if segs == list(range(segs[0], segs[-1] + 1)):
                first = starts[segs[0]]
                where = slice(first, first + length * len(segs))
            else:
                idx = [starts[s] + j for s in segs for j in range(length)]
                where = torch.tensor(idx, dtype=torch.int64, device=device)
            plan.append((length, len(segs), where))
        info.cache[key] = plan
    return info.cache[key]


class TorchSDPABackend(AttentionBackend):
    enum = AttentionBackendEnum.TORCH_SDPA
    not_batch_invariant = None  # per segment, position-independent; fixed shapes per sub-pack

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        info = pack_info(cu_seqlens, q.shape[0])
        gqa = q.shape[1] != k.shape[1]
        plan = _group_plan(info, q.device)
        if len(plan) == 1 and isinstance(plan[0][2], slice) and plan[0][2] == slice(0, q.shape[0]):
            return _batched(q, k, v, plan[0][0], plan[0][1], scale, gqa)
        out = torch.empty_like(q)
        for length, count, where in plan:
            if isinstance(where, slice):
                out[where] = _batched(q[where], k[where], v[where], length, count, scale, gqa)
            else:
                res = _batched(q[where], k[where], v[where], length, count, scale, gqa)
                out.index_copy_(0, where, res)
        return out


def _batched(q, k, v, length: int, count: int, scale: float, gqa: bool) -> torch.Tensor:
    # [count*L, H, D] -> [count, H, L, D]
    def split(x):
        return x.reshape(count, length, x.shape[1], x.shape[2]).transpose(1, 2)

    o = F.scaled_dot_product_attention(split(q), split(k), split(v), scale=scale, enable_gqa=gqa)
    return o.transpose(1, 2).reshape(count * length, q.shape[1], q.shape[2])
