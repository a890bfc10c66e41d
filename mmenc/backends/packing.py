"""Packed variable-length sequences: `cu_seqlens` and what backends derive from it, computed once.

A tower builds `cu_seqlens` once per forward with `make_cu_seqlens` and passes the same tensor to
every layer. The host-side view of the pack (segment lengths, length groups, a backend's block
mask, the sub-packs below) is remembered per `cu_seqlens` tensor, so no layer reads it back from
the device.

`sub_packs(info, short_seqlen_max, batch_invariant, device)` cuts a pack into the pieces the
dispatcher runs as packs of their own (index tensors made once per pack, on the host side):
  default mode     one sub-pack per segment-length class (short / long) when the pack has both;
                   None when it has one class (the pack runs as it is, at no extra cost)
  batch-invariant  per class and per segment length L, chunks of exactly C(L) segments
                   (C(L) = min(INVARIANT_CHUNK_SEGMENTS, max(1, INVARIANT_CHUNK_TOKENS // L))), the
                   last one padded with copies of
                   its first segment: every backend call for length L has the same shape, and a
                   segment's result cannot depend on the others. A class whose backend is
                   shape-independent (`whole`, see AttentionBackend.shape_independent) runs at once
                   instead, as in the default mode: its rows as a slice when they are one contiguous
                   run (no copy at all), else gathered; no chunks, no padding.
"""
import dataclasses
import functools
import itertools
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from mmenc.utils.device_copy import to_device

_PACKS = WeakTensorKeyDictionary()

# Batch-invariant mode: equal-length segments run in chunks of about this many tokens, and at most
# this many segments (tiny segments would otherwise pad to thousands of copies).
INVARIANT_CHUNK_TOKENS = 8192
INVARIANT_CHUNK_SEGMENTS = 128


@dataclasses.dataclass
class PackInfo:
    """Host view of one pack: `lengths[i]` tokens in segment i, in order."""

    lengths: tuple[int, ...]
    max_seqlen: int
    # Artefacts a backend derives from the pack (gather indices, block masks), keyed by the backend.
    cache: dict = dataclasses.field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @functools.cached_property
    def min_seqlen(self) -> int:
        """The shortest non-empty segment's length (0 for a pack with none)."""
        return min((n for n in self.lengths if n > 0), default=0)

    def length_groups(self) -> list[tuple[int, list[int]]]:
        """Segments grouped by length: [(length, [segment index, ...]), ...], lengths ascending."""
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(self.lengths):
            if n > 0:
                groups.setdefault(n, []).append(i)
        return sorted(groups.items())

    def starts(self) -> list[int]:
        return [0, *itertools.accumulate(self.lengths)][:-1]


def make_cu_seqlens(lengths: Sequence[int], device: torch.device | str | None = None) -> tuple[torch.Tensor, int]:
    """cu_seqlens int32 [N+1] on `device` for segments of `lengths`, and max_seqlen (a Python int)."""
    lengths = tuple(int(n) for n in lengths)
    if any(n < 0 for n in lengths):
        raise ValueError(f"segment lengths must be >= 0, got {list(lengths)}")
    cu = to_device(torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32), device)
    info = PackInfo(lengths=lengths, max_seqlen=max(lengths, default=0))
    _PACKS[cu] = info
    return cu, info.max_seqlen


def pack_info(cu_seqlens: torch.Tensor, num_tokens: int) -> PackInfo:
    """The host view of `cu_seqlens`, validated against `num_tokens`.

    A tensor from `make_cu_seqlens` costs nothing; any other is read back once (one device sync)
    and remembered for the following layers.
    """
    info = _PACKS.get(cu_seqlens)
    if info is None:
        info = _read_pack(cu_seqlens)
        _PACKS[cu_seqlens] = info
    if info.total != num_tokens:
        raise ValueError(
            f"cu_seqlens ends at {info.total} but the input has {num_tokens} tokens; "
            f"cu_seqlens[-1] must equal the token count")
    return info


def _read_pack(cu_seqlens: torch.Tensor) -> PackInfo:
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N+1], got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype != torch.int32:  # the kernels (FlashAttention, aiter, varlen) take int32 only
        raise ValueError(f"cu_seqlens must be int32, got {cu_seqlens.dtype}; build it with make_cu_seqlens "
                         f"or convert it with .to(torch.int32)")
    values = cu_seqlens.tolist()
    if values[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0]={values[0]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    bad = [i for i, n in enumerate(lengths) if n < 0]
    if bad:
        i = bad[0]
        raise ValueError(
            f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}]={values[i]} > cu_seqlens[{i + 1}]={values[i + 1]}")
    return PackInfo(lengths=tuple(lengths), max_seqlen=max(lengths, default=0))


@dataclasses.dataclass(frozen=True)
class SubPack:
    """Part of a pack run as a pack of its own.

    rows: the pack's token rows it reads, a slice or an int64 index tensor [n] (padding rows
        repeat real ones); dest: the pack rows its leading outputs are written back to (the same
        as rows without padding; the padding rows' outputs are dropped); cu_seqlens int32 [k+1] and
        max_seqlen: its own segments; short: whether they are the short class (<= short_seqlen_max).
    """

    rows: slice | torch.Tensor
    dest: slice | torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    short: bool


def sub_packs(info: PackInfo, short_seqlen_max: int | None, batch_invariant: bool,
              device: torch.device, whole: frozenset[bool] = frozenset()) -> list[SubPack] | None:
    """The sub-packs of a pack (see the module docstring); None: run the whole pack at once.
    `short_seqlen_max` None: one class (no short backend). `whole`: in batch-invariant mode, the
    classes (short? True/False) whose backend is shape-independent. Cached in `info.cache`."""
    key = ("sub_packs", short_seqlen_max, batch_invariant, device, whole if batch_invariant else frozenset())
    if key not in info.cache:
        info.cache[key] = _plan(info, short_seqlen_max, batch_invariant, device, whole)
    return info.cache[key]


def _plan(info: PackInfo, short_max: int | None, batch_invariant: bool, device,
          whole: frozenset[bool] = frozenset()) -> list[SubPack] | None:
    starts = info.starts()
    classes: dict[bool, list[int]] = {}  # short? -> its non-empty segments, in pack order
    for i, n in enumerate(info.lengths):
        if n > 0:
            classes.setdefault(short_max is not None and n <= short_max, []).append(i)
    if not batch_invariant:
        if len(classes) < 2:
            return None
        plans = []
        for short, segs in sorted(classes.items()):
            lengths = [info.lengths[s] for s in segs]
            rows = _rows([range(starts[s], starts[s] + info.lengths[s]) for s in segs], device)
            cu, max_seqlen = make_cu_seqlens(lengths, device)
            plans.append(SubPack(rows, rows, cu, max_seqlen, short))
        return plans
    plans = []
    for short, segs in sorted(classes.items()):
        if short in whole:  # shape-independent backend: the class at once, as in the default mode
            rows = _rows([range(starts[s], starts[s] + info.lengths[s]) for s in segs], device)
            cu, max_seqlen = make_cu_seqlens([info.lengths[s] for s in segs], device)
            plans.append(SubPack(rows, rows, cu, max_seqlen, short))
            continue
        by_length: dict[int, list[int]] = {}
        for s in segs:
            by_length.setdefault(info.lengths[s], []).append(s)
        for length, same in sorted(by_length.items()):
            count = chunk_segments(length)
            cu, _ = make_cu_seqlens([length] * count, device)
            for first in range(0, len(same), count):
                chunk = same[first:first + count]
                real = [range(starts[s], starts[s] + length) for s in chunk]
                pad = [real[0]] * (count - len(chunk))  # copies of a real segment: finite, dropped after
                rows = torch.tensor([r for seg in real + pad for r in seg], dtype=torch.int64, device=device)
                plans.append(SubPack(rows, rows[:len(chunk) * length], cu, length, short))
    return plans


def chunk_segments(length: int) -> int:
    """Segments per sub-pack for segments of `length` tokens in batch-invariant mode (a constant per length)."""
    return min(INVARIANT_CHUNK_SEGMENTS, max(1, INVARIANT_CHUNK_TOKENS // length))


def _rows(segments: list[range], device) -> slice | torch.Tensor:
    """The token rows of `segments` (in order): a slice when they are one contiguous run."""
    if all(a.stop == b.start for a, b in zip(segments, segments[1:])):
        return slice(segments[0].start, segments[-1].stop)
    return torch.tensor([r for seg in segments for r in seg], dtype=torch.int64, device=device)
