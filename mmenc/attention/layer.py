"""MMEncoderAttention: non-causal attention over packed variable-length sequences for vision towers."""
import functools
import math

import torch

from mmenc.attention.backend_enum import AttentionBackendEnum
from mmenc.attention.op import mm_encoder_attention
from mmenc.attention.packing import make_cu_seqlens
from mmenc.config import MultiModalConfig
from mmenc.custom_op import CustomOp


@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(CustomOp):
    """Encoder self-attention whose kernel backend the platform chooses once, at construction.

    forward(query, key, value, cu_seqlens=None, max_seqlen=None):
        query [B, S, Hq*D] or [B, S, Hq, D]; key, value likewise with Hkv heads.
        With cu_seqlens (int32 [N+1], 0 ... S), B must be 1 and attention stays inside each
        segment; max_seqlen is that pack's longest segment (a Python int, computed once per
        encoder forward). Without cu_seqlens each of the B rows is one sequence.
        Returns a tensor of the query's shape and dtype.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float | None = None,
                 num_kv_heads: int | None = None, prefix: str = "",
                 multimodal_config: MultiModalConfig | None = None, dtype: torch.dtype | None = None):
        config = multimodal_config or MultiModalConfig()
        super().__init__(custom_ops=config.custom_ops)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_heads <= 0 or head_size <= 0 or num_kv_heads <= 0:
            raise ValueError(f"{prefix or 'MMEncoderAttention'}: num_heads={num_heads}, num_kv_heads={num_kv_heads} "
                             f"and head_size={head_size} must all be positive")
        if num_heads % num_kv_heads:
            raise ValueError(f"{prefix or 'MMEncoderAttention'}: num_heads={num_heads} is not divisible by "
                             f"num_kv_heads={num_kv_heads}; expected a divisor of num_heads")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else scale
        self.prefix = prefix
        from mmenc.platforms import current_platform

        dtype = dtype or torch.get_default_dtype()
        self.backend: AttentionBackendEnum = current_platform.get_vit_attn_backend(
            head_size, dtype, config.mm_encoder_attn_backend)
        # Per-shape choice: packs whose longest segment is short (window layers) may run another
        # backend; decided from max_seqlen, a host int, so no device sync. None when not used.
        self.short_backend: AttentionBackendEnum | None = None
        self.short_seqlen_max = current_platform.short_seqlen_max
        if config.mm_encoder_attn_backend is None:
            self.short_backend = current_platform.get_vit_attn_short_backend(head_size, dtype, self.backend)

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"backend={self.describe_backend()}")

    def describe_backend(self) -> str:
        """"TORCH_SDPA", or with a per-shape choice "FLASH_ATTN (TRITON_ATTN for segments <= 256)"."""
        if self.short_backend is None:
            return self.backend.name
        return f"{self.backend.name} ({self.short_backend.name} for segments <= {self.short_seqlen_max})"

    def forward_native(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        return self._run((AttentionBackendEnum.TORCH_SDPA, None), query, key, value, cu_seqlens, max_seqlen)

    def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        return self._run((self.backend, self.short_backend), query, key, value, cu_seqlens, max_seqlen)

    forward_cpu = forward_xpu = forward_tpu = forward_oot = forward_cuda

    def _run(self, backends, query, key, value, cu_seqlens, max_seqlen):
        q, batch, seq = self._to_packed(query, self.num_heads, "query")
        k, _, _ = self._to_packed(key, self.num_kv_heads, "key", batch, seq)
        v, _, _ = self._to_packed(value, self.num_kv_heads, "value", batch, seq)
        if cu_seqlens is None:
            cu_seqlens, max_seqlen = _uniform_cu_seqlens(batch, seq, q.device)
        elif batch != 1:
            raise ValueError(f"{self._name}: with cu_seqlens the batch size must be 1 (a packed sequence), "
                             f"got batch={batch}")
        elif max_seqlen is None:
            raise ValueError(f"{self._name}: max_seqlen is required with cu_seqlens (compute it once per encoder "
                             f"forward, e.g. with mmenc.attention.make_cu_seqlens)")
        elif cu_seqlens.device != q.device:
            raise ValueError(f"{self._name}: cu_seqlens is on {cu_seqlens.device} but query is on {q.device}; "
                             f"make it on the query's device (make_cu_seqlens(lengths, device))")
        main, short = backends
        out = mm_encoder_attention(q, k, v, cu_seqlens, max_seqlen, self.scale, main.name,
                                   short.name if short else "", self.short_seqlen_max)  # [T, Hq, D]
        return out.reshape(query.shape)

    @property
    def _name(self) -> str:
        return self.prefix or "MMEncoderAttention"

    def _to_packed(self, x: torch.Tensor, heads: int, what: str, batch: int | None = None,
                   seq: int | None = None) -> tuple[torch.Tensor, int, int]:
        """[B, S, H*D] or [B, S, H, D] -> ([B*S, H, D], B, S), checking the shape."""
        d = self.head_size
        if x.dim() == 3 and x.shape[-1] == heads * d:
            b, s = x.shape[:2]
        elif x.dim() == 4 and tuple(x.shape[2:]) == (heads, d):
            b, s = x.shape[:2]
        else:
            raise ValueError(f"{self._name}: {what} has shape {tuple(x.shape)}; expected [B, S, {heads * d}] or "
                             f"[B, S, {heads}, {d}] ({heads} heads of size {d})")
        if batch is not None and (b, s) != (batch, seq):
            raise ValueError(f"{self._name}: {what} has batch/sequence {(b, s)} but query has {(batch, seq)}")
        return x.reshape(b * s, heads, d), b, s


@functools.lru_cache(maxsize=64)
def _uniform_cu_seqlens(batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """cu_seqlens for `batch` sequences of `seq` tokens each, made once per (batch, seq, device)."""
    return make_cu_seqlens([seq] * batch, device)
