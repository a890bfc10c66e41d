"""MMEncoderAttention: non-causal attention over packed variable-length sequences for vision towers."""
import functools
import math

import torch

from mmenc.backends import AttentionBackendEnum, BackendChoice, make_cu_seqlens
from mmenc.backends.dispatch import attend
from mmenc.config import MultiModalConfig, current_multimodal_config
from mmenc.custom_op import CustomOp
from mmenc.platforms import platform_for

# forward_native: plain PyTorch everywhere (per batch-invariance setting)
_NATIVE = {flag: BackendChoice(AttentionBackendEnum.TORCH_SDPA, batch_invariant=flag) for flag in (False, True)}


@CustomOp.register("mm_encoder_attn")
class MMEncoderAttention(CustomOp):
    """Encoder self-attention whose kernel backend the platform of its device chooses, once.

    The choice (`.choice`, a BackendChoice: `.backend` plus the short-segment `.short_backend`) is
    made at construction for `device` (None: the current platform's device type), from
    `multimodal_config` (the requested backend, custom_ops, batch_invariant); None reads the build
    context, `mmenc.config.current_multimodal_config()` (what build_tower builds under; the default
    MultiModalConfig() outside one). Tensors that arrive on a device of another type (the tower was
    moved with .to()) get the choice of that device's platform, made once per device type.

    forward(query, key, value, cu_seqlens=None, max_seqlen=None):
        query [B, S, Hq*D] or [B, S, Hq, D]; key, value likewise with Hkv heads; one floating
        dtype and one device for all three. With cu_seqlens (int32 [N+1], 0 ... S), B must be 1
        and attention stays inside each segment; max_seqlen is that pack's longest segment (a
        Python int, computed once per encoder forward). Without cu_seqlens each of the B rows is
        one sequence. Returns a tensor of the query's shape and dtype.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float | None = None,
                 num_kv_heads: int | None = None, prefix: str = "",
                 multimodal_config: MultiModalConfig | None = None, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None):
        config = multimodal_config if multimodal_config is not None else current_multimodal_config()
        platform = platform_for(device)
        super().__init__(custom_ops=config.custom_ops, platform=platform)
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
        self._requested = config.mm_encoder_attn_backend
        self._batch_invariant = config.batch_invariant
        self._dtype = dtype or torch.get_default_dtype()
        self._device_type = platform.device_type
        self.choice: BackendChoice = platform.choose_vit_attn(head_size, self._dtype, self._requested,
                                                                   self._batch_invariant)
        self._elsewhere: dict[str, tuple[BackendChoice, object]] = {}  # device type -> (choice, forward method)

    @property
    def backend(self) -> AttentionBackendEnum:
        return self.choice.main

    @property
    def short_backend(self) -> AttentionBackendEnum | None:
        return self.choice.short

    @property
    def short_seqlen_max(self) -> int:
        return self.choice.short_seqlen_max

    def extra_repr(self) -> str:
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"backend={self.describe_backend()}")

    def describe_backend(self) -> str:
        """"TORCH_SDPA", or with a per-shape choice "FLASH_ATTN (TRITON_ATTN for segments <= 256)"."""
        return self.choice.describe()

    def forward(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        if query.device.type == self._device_type:
            return self._forward_method(query, key, value, cu_seqlens, max_seqlen)
        return self._on(query.device)[1](query, key, value, cu_seqlens, max_seqlen)

    def forward_native(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        return self._run(_NATIVE[self._batch_invariant], query, key, value, cu_seqlens, max_seqlen)

    def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None):
        choice = self.choice if query.device.type == self._device_type else self._on(query.device)[0]
        return self._run(choice, query, key, value, cu_seqlens, max_seqlen)

    forward_cpu = forward_xpu = forward_tpu = forward_oot = forward_cuda

    def _on(self, device: torch.device) -> tuple[BackendChoice, object]:
        """(choice, forward method) for tensors on a device of another type than the construction's."""
        if device.type not in self._elsewhere:
            platform = platform_for(device)
            try:
                choice = platform.choose_vit_attn(self.head_size, self._dtype, self._requested, self._batch_invariant)
            except ValueError as e:
                raise ValueError(f"{self._name}: built for {self._device_type}, called with tensors on {device}: "
                                 f"{e}") from None
            self._elsewhere[device.type] = (choice, self.forward_method_for(platform))
        return self._elsewhere[device.type]

    def _run(self, choice: BackendChoice, query, key, value, cu_seqlens, max_seqlen):
        self._check_inputs(query, key, value)
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
        out = attend(q, k, v, cu_seqlens, max_seqlen, self.scale, choice)  # [T, Hq, D]
        return out.reshape(query.shape)

    @property
    def _name(self) -> str:
        return self.prefix or "MMEncoderAttention"

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """One floating dtype and one device for q, k and v, whatever the backend (host-side only)."""
        dtypes = (query.dtype, key.dtype, value.dtype)
        if not query.is_floating_point() or dtypes.count(query.dtype) != 3:
            names = ", ".join(f"{w} {str(d).removeprefix('torch.')}" for w, d in zip(("query", "key", "value"), dtypes))
            raise ValueError(f"{self._name}: query, key and value must share one floating-point dtype, got {names}; "
                             f"cast them to one (e.g. .to(query.dtype)) before attention")
        devices = (query.device, key.device, value.device)
        if devices.count(query.device) != 3:
            raise ValueError(f"{self._name}: query, key and value must be on one device, got query on {devices[0]}, "
                             f"key on {devices[1]}, value on {devices[2]}")

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
