"""BackendChoice: which backend runs which segments of a pack, the one place that holds the rule.

A platform makes the choice once per (head size, dtype, device type, batch invariance); the layer
carries it; the dispatcher (`mmenc.backends.dispatch`) applies it per segment-length class inside
each pack: segments of <= `short_seqlen_max` tokens run the short backend, longer ones the main
backend, in the same layer call. Which kernel an image's rows get therefore depends only on that
image's own segments, never on what else shares the pack. `mmenc backends` prints the choice.
"""
import dataclasses

from mmenc.backends.backend_enum import AttentionBackendEnum

# Segments up to this many tokens count as "short" (Qwen2.5-VL's windows: 64 tokens).
SHORT_SEQLEN_MAX = 256


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """`main` runs every segment longer than `short_seqlen_max` tokens, `short` the others when it is
    set (None: `main` runs every segment). `batch_invariant`: the pack runs as fixed-shape sub-packs
    of equal-length segments (see mmenc.backends.packing.SubPack), so each segment's result is
    bitwise independent of the rest of the pack; both backends were chosen able to do that."""

    main: AttentionBackendEnum
    short: AttentionBackendEnum | None = None
    short_seqlen_max: int = SHORT_SEQLEN_MAX
    batch_invariant: bool = False

    def __post_init__(self):
        if self.short == self.main:
            object.__setattr__(self, "short", None)
        if self.short_seqlen_max < 0:
            raise ValueError(f"short_seqlen_max={self.short_seqlen_max} must be >= 0")

    def backend_for(self, seqlen: int) -> AttentionBackendEnum:
        """The backend for a segment of `seqlen` tokens."""
        if self.short is not None and seqlen <= self.short_seqlen_max:
            return self.short
        return self.main

    def describe(self) -> str:
        """"TORCH_SDPA", or with a per-shape choice "FLASH_ATTN (TRITON_ATTN for segments <= 256)";
        ", batch-invariant" appended in that mode."""
        text = self.main.name
        if self.short is not None:
            text += f" ({self.short.name} for segments <= {self.short_seqlen_max})"
        return text + (", batch-invariant" if self.batch_invariant else "")
