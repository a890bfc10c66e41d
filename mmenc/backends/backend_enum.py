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
        return member_by_name(cls, name, "attention")


def member_by_name(cls: type[enum.Enum], name, kind: str):
    """The member of `cls` named `name` in any case ("-" for "_"), or `name` itself when it is one;
    ValueError naming the value and the valid names otherwise. kind: "attention", "linear"."""
    if isinstance(name, cls):
        return name
    if not isinstance(name, str):
        raise ValueError(f"{kind} backend must be a name or {cls.__name__}, got {name!r}")
    key = name.strip().upper().replace("-", "_")
    if key in cls.__members__:
        return cls[key]
    raise ValueError(f"unknown {kind} backend {name!r}; valid names: {', '.join(cls.__members__)}")
