"""The names of the encoder-attention kernel backends."""
import enum


class AttentionBackendEnum(enum.Enum):
    NAIVE = "naive"
    TORCH_SDPA = "torch_sdpa"
    TORCH_VARLEN = "torch_varlen"
    FLEX_ATTENTION = "flex_attention"
    FLASH_ATTN = "flash_attn"
    TRITON_ATTN = "triton_attn"
    XFORMERS = "xformers"
    ROCM_AITER_FA = "rocm_aiter_fa"
    PALLAS = "pallas"

    @classmethod
    def from_name(cls, name: "str | AttentionBackendEnum") -> "AttentionBackendEnum":
        """Case-insensitive lookup (`"torch_sdpa"`, `"TORCH_SDPA"`); members pass through."""
        if isinstance(name, cls):
            return name
        if not isinstance(name, str):
            raise ValueError(f"attention backend must be a name or AttentionBackendEnum, got {name!r}")
        key = name.strip().upper().replace("-", "_")
        if key in cls.__members__:
            return cls[key]
        valid = ", ".join(cls.__members__)
        raise ValueError(f"unknown attention backend {name!r}; valid names: {valid}")
