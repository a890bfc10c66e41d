"""Packed variable-length sequences: `cu_seqlens` and what backends derive from it, computed once.

A tower builds `cu_seqlens` once per forward with `make_cu_seqlens` and passes the same tensor to
every layer. The host-side view of the pack (segment lengths, length groups, a backend's block
mask) is remembered per `cu_seqlens` tensor, so no layer reads it back from the device.
"""
import dataclasses
import itertools
from collections.abc import Sequence

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from mmenc.backends.device import to_device

_PACKS = WeakTensorKeyDictionary()


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
