"""PALLAS: torch_xla's Pallas FlashAttention on TPU, segments expressed as segment ids.

The pack is one batch row; q and kv segment ids (one id per token, from cu_seqlens) keep attention
inside each segment. The ids are built once per pack (cached in `pack_info(...).cache`), with the
row padded to a multiple of the kernel's 128-token block: padding tokens get an id of their own.
"""
import functools

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend, collect, need_device
from mmenc.backends.packing import pack_info

BLOCK = 128


@functools.cache
def _flash_attention():
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention


def segment_ids(cu_seqlens: torch.Tensor, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """(segment ids [1, P] int32 on `device`, padded length P) for the pack, made once per pack."""
    info = pack_info(cu_seqlens, num_tokens)
    key = ("pallas_segment_ids", device)
    if key not in info.cache:
        padded = num_tokens if num_tokens <= BLOCK else -(-num_tokens // BLOCK) * BLOCK
        n = len(info.lengths)  # padding tokens form segment n, a segment of their own
        lengths = torch.tensor([*info.lengths, padded - num_tokens])
        ids = torch.repeat_interleave(torch.arange(n + 1, dtype=torch.int32), lengths)  # [P], on the host
        info.cache[key] = (ids[None].to(device), padded)
    return info.cache[key]


class PallasBackend(AttentionBackend):
    enum = AttentionBackendEnum.PALLAS
    not_batch_invariant = ("its 128-token blocks span segment boundaries, so a segment's partial sums depend on its "
                           "offset in the pack")
    requires = ("torch_xla", "torch-xla")

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        reasons = collect(need_device(device, "xla"))
        if dtype not in (torch.bfloat16, torch.float32):
            reasons.append(f"{str(dtype).removeprefix('torch.')} is not supported on TPU (bfloat16 or float32)")
        return reasons

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        t, hq, d = q.shape
        ids, padded = segment_ids(cu_seqlens, t, q.device)
        if k.shape[1] != hq:  # the kernel has no GQA: [T, Hkv, D] -> [T, Hq, D]
            k, v = (x.repeat_interleave(hq // k.shape[1], dim=1) for x in (k, v))
        pad = padded - t
        # [T, H, D] -> [1, H, P, D]
        q4, k4, v4 = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1)[None] for x in (q, k, v))
        out = _flash_attention()(q4, k4, v4, causal=False, q_segment_ids=ids, kv_segment_ids=ids, sm_scale=scale)
        return out[0, :, :t].transpose(0, 1)  # [1, Hq, P, D] -> [T, Hq, D]
