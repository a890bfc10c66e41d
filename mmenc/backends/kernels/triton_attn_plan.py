"""Host-side planning for TRITON_ATTN (pure Python, no Triton needed): launch configurations and
the per-pack tables the kernels read, built once per pack from its PackInfo and cached there.

    KernelConfig, CONFIGS      launch configurations per (length bucket, head class)
    head_split(d)              72 -> (64, 16): two power-of-two dot parts instead of padding to 128
    tile_table(info, ...)      int32 [tiles, 5] (q_lo, q_hi, kv_lo, kv_hi, unmasked KV blocks) + segment ids
    window_table(info, ...)    int32 [n + 1] segment starts, for packs of windows that each fit a tile
"""
import dataclasses

import torch

from mmenc.backends.choice import SHORT_SEQLEN_MAX
from mmenc.backends.packing import PackInfo
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """One launch configuration; `split` cuts non-power-of-two head sizes into two dot parts."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    split: bool = True
    tma: bool = False  # K/V through TMA descriptors (Hopper+; falls back to pointer loads elsewhere)
    windows: int = 0  # > 0: packs whose segments all fit block_m run the windows kernel, this many per program

    def __str__(self) -> str:
        return (f"m{self.block_m}n{self.block_n}w{self.num_warps}s{self.num_stages}"
                f"{'' if self.split else '-pad'}{'-tma' if self.tma else ''}"
                f"{f'-win{self.windows}' if self.windows else ''}")


# Candidates per (length bucket, head class), best guess first; ("<bucket>", "any") is the fallback.
# The head class is the head split ("64", "64+16" for 72 and 80, "128"), i.e. the compiled shapes.
# With two candidates, the first call per (head size, dtype, GQA group, bucket) times both on its own
# inputs and keeps the faster; with one it just runs it. `attention_bench.py --sweep-only` prints
# replacement entries to paste here (winner + runner-up per key).
_K = KernelConfig
CONFIGS: dict[tuple[str, str], list[KernelConfig]] = {
    ("short", "any"): [_K(64, 64, 4, 2, windows=4), _K(64, 64, 4, 3, windows=4)],
    # from the H200 sweep of 2026-11-30 (session 2; TFLOP/s of the winner on 684 x 64-token windows or 8 x 5476)
    ("short", "64"): [_K(64, 64, 4, 2, windows=2), _K(64, 64, 4, 2, windows=4)],  # 113
    ("short", "64+16"): [_K(64, 64, 4, 2, windows=8), _K(64, 64, 4, 2, windows=4)],  # d80 99, d72 77
    ("short", "128"): [_K(64, 64, 4, 2, windows=4), _K(64, 64, 4, 2, windows=8)],  # 120; s3: 152 KiB smem, 1 CTA/SM
    ("mid", "any"): [_K(128, 64, 8, 3, tma=True), _K(128, 128, 8, 2, tma=True)],
    ("long", "any"): [_K(128, 64, 8, 3, tma=True), _K(128, 128, 8, 2, tma=True)],
    ("long", "64"): [_K(128, 64, 4, 3, tma=True), _K(64, 64, 4, 3, tma=True)],  # 457
    ("long", "64+16"): [_K(128, 64, 4, 3, tma=True), _K(128, 64, 8, 2, tma=True)],  # d80 437, d72 372
    ("long", "128"): [_K(128, 128, 8, 3, tma=True), _K(128, 64, 8, 3, tma=True)],  # 497
    **{(bucket, "256"): [_K(64, 64, 4, 2, tma=True)] for bucket in ("short", "mid", "long")},  # fits 227 KiB smem
}


def length_bucket(max_seqlen: int) -> str:
    """"short" is the packs the platforms' short-segment choice sends here (windows), tuned apart."""
    return "short" if max_seqlen <= SHORT_SEQLEN_MAX else "mid" if max_seqlen <= 2048 else "long"


def head_class(head_size: int) -> str:
    """The CONFIGS key part for a head size: its split, e.g. 72 -> "64+16", 64 -> "64"."""
    da, db = head_split(head_size)
    return f"{da}+{db}" if db else str(da)


def candidates(head_size: int, max_seqlen: int) -> list[KernelConfig]:
    bucket = length_bucket(max_seqlen)
    return CONFIGS.get((bucket, head_class(head_size))) or CONFIGS[(bucket, "any")]


def head_split(head_size: int, split: bool = True) -> tuple[int, int]:
    """(DA, DB): the head dimension as a power-of-two part plus a second one (0: none); both >= 16
    as tl.dot needs. 80 -> (64, 16), 72 -> (64, 16), 96 -> (64, 32), 112 -> (128, 0), 17 -> (32, 0)."""
    whole = max(16, 1 << (head_size - 1).bit_length())
    if not split or head_size <= 16:
        return whole, 0
    da = 1 << (head_size.bit_length() - 1)
    rest = head_size - da
    if rest == 0:
        return da, 0
    db = max(16, 1 << (rest - 1).bit_length())
    return (da, db) if da + db < whole else (whole, 0)


def tile_table(info: PackInfo, block_m: int, block_n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tiles int32 [n, 5], seg_ids int32 [T]) for the pack, built on the host once and cached."""
    key = ("triton_attn_tiles", block_m, block_n, device)
    if key not in info.cache:
        tiles, group, group_start, pos = [], [], 0, 0

        def flush():
            if group:
                end = group_start + sum(group)
                full = (end - group_start) // block_n if len(group) == 1 else 0
                tiles.append((group_start, end, group_start, end, full))
                group.clear()

        for n in info.lengths:
            if n > block_m:
                flush()
                end = pos + n
                tiles += [(s, min(s + block_m, end), pos, end, n // block_n) for s in range(pos, end, block_m)]
            elif n > 0:
                if sum(group) + n > block_m:
                    flush()
                if not group:
                    group_start = pos
                group.append(n)
            pos += n
        flush()
        tiles.sort(key=lambda t: t[2] - t[3])  # longest KV range first: better load balance
        seg_ids = torch.repeat_interleave(torch.arange(len(info.lengths), dtype=torch.int32),
                                          torch.tensor(info.lengths, dtype=torch.int64))
        info.cache[key] = (to_device(torch.tensor(tiles, dtype=torch.int32), device), to_device(seg_ids, device))
    return info.cache[key]


def window_table(info: PackInfo, device: torch.device) -> torch.Tensor:
    """int32 [n + 1]: the starts of the n non-empty segments, then the pack's end; cached per pack."""
    key = ("triton_attn_windows", device)
    if key not in info.cache:
        starts = [s for s, n in zip(info.starts(), info.lengths) if n > 0]
        info.cache[key] = to_device(torch.tensor(starts + [sum(info.lengths)], dtype=torch.int32), device)
    return info.cache[key]


# Batch-invariant mode (mmenc/backends/kernels/triton_invariant.py): one (windows, tiles) pair per head
# class, never timed, no TMA. Segments of <= the windows config's block_m tokens run the windows kernel,
# longer ones tiles of their own. Changing an entry changes results (they stay invariant).
INVARIANT_CONFIGS: dict[str, tuple[KernelConfig, KernelConfig]] = {
    "any": (_K(64, 64, 4, 2, windows=4), _K(64, 64, 4, 2)),
    "64": (_K(64, 64, 4, 2, windows=2), _K(128, 64, 4, 3)),  # windows per program as the sweep's winners
    "64+16": (_K(64, 64, 4, 2, windows=8), _K(128, 64, 4, 3)),  # (CONFIGS); it does not change the results
    "128": (_K(64, 64, 4, 2, windows=4), _K(128, 64, 8, 2)),
}


def invariant_configs(head_size: int) -> tuple[KernelConfig, KernelConfig]:
    """(windows config, tiles config) of batch-invariant mode for this head size."""
    return INVARIANT_CONFIGS.get(head_class(head_size), INVARIANT_CONFIGS["any"])


def segment_tables(info: PackInfo, window_max: int, block_m: int, block_n: int,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch-invariant mode's tables, cached per pack: (windows int32 [w, 2] (start, end) of every
    segment of 1..window_max tokens; tiles int32 [n, 5] as tile_table's, for the longer segments only,
    each cut into tiles from its own start, never shared; seg_ids int32 [T])."""
    key = ("triton_attn_invariant", window_max, block_m, block_n, device)
    if key not in info.cache:
        windows, tiles = [], []
        for pos, n in zip(info.starts(), info.lengths):
            if 0 < n <= window_max:
                windows.append((pos, pos + n))
            elif n > window_max:
                end = pos + n
                tiles += [(s, min(s + block_m, end), pos, end, n // block_n) for s in range(pos, end, block_m)]
        tiles.sort(key=lambda t: t[2] - t[3])  # longest KV range first: better load balance
        seg_ids = torch.repeat_interleave(torch.arange(len(info.lengths), dtype=torch.int32),
                                          torch.tensor(info.lengths, dtype=torch.int64))
        info.cache[key] = (to_device(torch.tensor(windows, dtype=torch.int32).reshape(-1, 2), device),
                           to_device(torch.tensor(tiles, dtype=torch.int32).reshape(-1, 5), device),
                           to_device(seg_ids, device))
    return info.cache[key]
