"""TRITON_ATTN: mmenc's own varlen attention kernel (mmenc/backends/kernels/triton_varlen_attn.py).

One launch per layer for any pack: long segments are cut into 128-row query tiles, runs of short
windows are packed into one tile with a block-diagonal mask, or (packs of windows that each fit a
block) attend window by window, several per program. Any head size from 1 to 256 (multiples
of 8 run fastest); non-powers of two (72, 80) are split into two power-of-two parts rather than
padded. The kernel's tile table is built once per pack (cached in PackInfo.cache); the kernel is a
torch custom op, so compiled towers trace through it. Batch-invariant mode runs its fixed-config
path instead (mmenc/backends/kernels/triton_invariant.py): no timing, no shared tiles.
"""
from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend, collect, need_half, need_nvidia_capability

MAX_HEAD_SIZE = 256


class TritonAttnBackend(AttentionBackend):
    enum = AttentionBackendEnum.TRITON_ATTN
    # Its tuned path times configs per process and packs short segments into shared tiles; batch-invariant
    # mode runs forward_batch_invariant instead: fixed configs, each segment blocked on its own
    # (mmenc/backends/kernels/triton_invariant.py), so any pack shape gives a segment the same result.
    not_batch_invariant = None
    shape_independent = True
    requires = ("triton", "triton")

    @classmethod
    def _reasons(cls, head_size, dtype, device):
        if device.is_rocm:
            gpu = "not validated on ROCm (tested on NVIDIA GPUs only)"
        else:
            gpu = need_nvidia_capability(device, 8, 0)
        size = None
        if not 1 <= head_size <= MAX_HEAD_SIZE:
            size = f"head_size {head_size} is not supported (1 to {MAX_HEAD_SIZE})"
        return collect(gpu, need_half(dtype), size)

    @classmethod
    def forward(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        from mmenc.backends.kernels.triton_varlen_attn import varlen_attention

        return varlen_attention(q, k, v, cu_seqlens, max_seqlen, scale)

    @classmethod
    def forward_batch_invariant(cls, q, k, v, cu_seqlens, max_seqlen, scale):
        from mmenc.backends.kernels.triton_invariant import varlen_attention_invariant

        return varlen_attention_invariant(q, k, v, cu_seqlens, scale)
