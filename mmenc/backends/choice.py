"""BackendChoice: which backend runs a pack, the one place that applies the per-shape rule.

A platform makes the choice once per (head size, dtype, device type); the layer carries it; the
dispatcher (`mmenc.backends.dispatch`) asks it for each pack's backend from `max_seqlen`, a host
integer, so choosing costs no device synchronisation; `mmenc backends` prints it.
"""
import dataclasses

from mmenc.backends.backend_enum import AttentionBackendEnum

# Segments up to this many tokens count as "short" (Qwen2.5-VL's windows: 64 tokens).
SHORT_SEQLEN_MAX = 256


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """`main` runs every pack, except packs whose longest segment is <= `short_seqlen_max` tokens,
    which run `short` when it is set (None: no per-shape choice)."""

    main: AttentionBackendEnum
    short: AttentionBackendEnum | None = None
    short_seqlen_max: int = SHORT_SEQLEN_MAX

    def __post_init__(self):
        if self.short == self.main:
            object.__setattr__(self, "short", None)
        if self.short_seqlen_max < 0:
            raise ValueError(f"short_seqlen_max={self.short_seqlen_max} must be >= 0")

    def backend_for(self, max_seqlen: int) -> AttentionBackendEnum:
        """The backend for a pack whose longest segment has `max_seqlen` tokens."""
        if self.short is not None and max_seqlen <= self.short_seqlen_max:
            return self.short
        return self.main

    def describe(self) -> str:
        """"TORCH_SDPA", or with a per-shape choice "FLASH_ATTN (TRITON_ATTN for segments <= 256)"."""
        if self.short is None:
            return self.main.name
        return f"{self.main.name} ({self.short.name} for segments <= {self.short_seqlen_max})"
