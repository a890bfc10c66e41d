"""How a stream of images is cut into tower calls: a growing chunk schedule.

    schedule = ChunkSchedule(max_patches=65536, first_patches=4096, growth=2.0)
    schedule.split([5476] * 8)        # images per tower call: [1, 2, 4, 1]

The first call of an `encode`/`encode_iter` takes at most `first_patches` rows (at least one image),
so the tower starts as soon as the first images are ready; each later call may take up to `growth`
times the previous call's limit or rows (the larger), capped at `max_patches`, so the tower is never
waiting for the whole rest of a call to be decoded. Every chunk holds whole images in input order
and is filled greedily, so the cut depends only on the images' sizes (never on timing): the same
inputs always give the same packings, which is what lets CUDA graphs replay (a packing is a graph key).
growth=math.inf: the first call, then calls of max_patches (the schedule before growth existed).
"""
import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class ChunkSchedule:
    """max_patches: rows of a tower call (an image larger than that is a call alone); first_patches:
    rows of the first call (None: max_patches); growth: >= 1, how fast the limit grows (see module doc)."""

    max_patches: int
    first_patches: int | None = None
    growth: float = 2.0

    def __post_init__(self):
        for name in ("max_patches", "first_patches"):
            value = getattr(self, name)
            if value is None and name == "first_patches":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ChunkSchedule.{name}={value!r} must be an int >= 1, e.g. 65536")
        if isinstance(self.growth, bool) or not isinstance(self.growth, (int, float)) or not self.growth >= 1:
            raise ValueError(f"ChunkSchedule.growth={self.growth!r} must be a number >= 1 (1: every call at "
                             f"first_patches; 2: doubling; math.inf: first call, then max_patches)")

    def first_limit(self) -> int:
        return min(self.first_patches or self.max_patches, self.max_patches)

    def next_limit(self, limit: int, rows: int) -> int:
        """The limit of the call after one whose limit was `limit` and which took `rows` rows."""
        if math.isinf(self.growth):
            return self.max_patches
        return min(self.max_patches, math.ceil(max(limit, rows) * self.growth))

    def split(self, rows: Sequence[int]) -> list[int]:
        """Images per tower call for images of `rows` rows each, in order (what the pipeline does)."""
        counts: list[int] = []
        limit, taken, n = self.first_limit(), 0, 0
        for r in rows:
            if n and taken + r > limit:
                counts.append(n)
                limit, taken, n = self.next_limit(limit, taken), 0, 0
            taken, n = taken + r, n + 1
            if taken >= limit:  # full (or one image over the limit): nothing more fits
                counts.append(n)
                limit, taken, n = self.next_limit(limit, taken), 0, 0
        return counts + ([n] if n else [])
