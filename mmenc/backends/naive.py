"""NAIVE: the plain-PyTorch reference (float32 softmax, one segment at a time). The test oracle."""
import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend
from mmenc.backends.packing import pack_info


class NaiveBackend(AttentionBackend):
    enum = AttentionBackendEnum.NAIVE
    not_batch_invariant = None  # per segment, position-independent; fixed shapes per sub-pack

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        info = pack_info(cu_seqlens, q.shape[0])
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, n in zip(info.starts(), info.lengths):
            if n == 0:
                continue
            qs = q[start:start + n].float().transpose(0, 1)  # [Hq, n, D]
            ks = k[start:start + n].float().transpose(0, 1).repeat_interleave(groups, dim=0)
            vs = v[start:start + n].float().transpose(0, 1).repeat_interleave(groups, dim=0)
            probs = torch.softmax((qs @ ks.transpose(1, 2)) * scale, dim=-1)  # [Hq, n, n]
            out[start:start + n] = (probs @ vs).transpose(0, 1).to(q.dtype)
        return out
