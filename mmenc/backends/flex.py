"""FLEX_ATTENTION: torch's flex_attention with a document mask derived from cu_seqlens.

The BlockMask is built from the segment boundaries in O(blocks^2) device work (never an O(T^2)
dense mask) once per pack and kept in `pack_info(...).cache`; flex_attention is compiled once
per process (shapes become dynamic after the first new pack length).
"""
import functools

import torch

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend, collect, need_device, need_nvidia_capability
from mmenc.backends.packing import pack_info

BLOCK = 128


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def block_mask(cu_seqlens: torch.Tensor, num_tokens: int):
    """The BlockMask confining attention to each segment of the pack, made once per pack."""
    info = pack_info(cu_seqlens, num_tokens)
    key = ("flex_block_mask", cu_seqlens.device)
    if key not in info.cache:
        info.cache[key] = _document_block_mask(cu_seqlens, num_tokens)
    return info.cache[key]


def _document_block_mask(cu_seqlens: torch.Tensor, t: int):
    from torch.nn.attention.flex_attention import BlockMask

    device = cu_seqlens.device
    tokens = torch.arange(t, device=device, dtype=cu_seqlens.dtype)
    doc = torch.searchsorted(cu_seqlens[1:], tokens, right=True)  # [T] segment of each token

    def mask_mod(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    # Segment ids are non-decreasing, so block i spans segments [first[i], last[i]].
    starts = torch.arange(0, t, BLOCK, device=device)
    first, last = doc[starts], doc[torch.clamp(starts + BLOCK, max=t) - 1]
    overlap = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])  # [nb, nb]
    whole = (first == last) & (starts + BLOCK <= t)  # a complete block inside one segment
    full = overlap & whole[:, None] & whole[None, :] & (first[:, None] == first[None, :])
    partial = overlap & ~full
    return BlockMask.from_kv_blocks(*_ordered(partial), *_ordered(full), BLOCK_SIZE=BLOCK,
                                    mask_mod=mask_mod, seq_lengths=(t, t))


def _ordered(dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nq, nkv] bool -> (kv_num_blocks [1, 1, nq], kv_indices [1, 1, nq, nkv]) int32."""
    dense = dense.to(torch.int32)
    num = dense.sum(-1, dtype=torch.int32)
    idx = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), idx[None, None].contiguous()


class FlexAttentionBackend(AttentionBackend):
    enum = AttentionBackendEnum.FLEX_ATTENTION
    not_batch_invariant = ("its 128-token blocks span segment boundaries, so a segment's partial sums depend on its "
                           "offset in the pack")

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        if device.type == "cpu":
            reasons = ["compiled flex_attention is not used on CPU: inductor's C++ flex kernel fails to "
                       "compile with dynamic shapes (seen on torch 2.13), so each new pack length would "
                       "recompile; TORCH_SDPA is the CPU path"]
        else:
            reasons = collect(need_device(device, "cuda", "xpu"))
        if device.type == "cuda" and device.is_nvidia:
            reasons += collect(need_nvidia_capability(device, 8, 0))
        if head_size < 16:
            reasons.append(f"head_size {head_size} is smaller than 16 (Triton's dot product needs >= 16)")
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"{str(dtype).removeprefix('torch.')} is not supported")
        return reasons

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        t = q.shape[0]
        mask = block_mask(cu_seqlens, t)
        # [T, H, D] -> [1, H, T, D]
        q4, k4, v4 = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        options = {"FORCE_USE_FLEX_ATTENTION": True} if q.device.type != "cpu" else None  # no decode kernel for T < 128
        out = _compiled_flex()(q4, k4, v4, block_mask=mask, scale=scale,
                               enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)
        return out[0].transpose(0, 1)  # [1, Hq, T, D] -> [T, Hq, D]
