"""Allocation traces of a forward on the CPU, extrapolated in the token count and replayed through a model
of the CUDA caching allocator: what a CUDA-graph pool would hold for the same forward, without a GPU.

`trace(fn)`: the (event, ptr, bytes) sequence torch.profiler records for fn() (allocations and frees
on the CPU allocator). Two traces of the same forward at two token counts have the same events in the
same order when the code path does not depend on the count; `extrapolate` fits each event's size as
a + b * tokens and gives the sizes at the full count.

`CachingAllocatorModel`: the large-block pool of PyTorch's CUDACachingAllocator (the part that holds
activations: requests over 1 MiB), as a private graph pool behaves during a capture: best-fit over free
blocks (smallest first), blocks split when more than 1 MiB would remain, adjacent free blocks merged,
a new segment (the request rounded up to 2 MiB; 20 MiB under 10 MiB) when nothing fits, and segments never given back.
`reserved` after a replayed trace is the pool's size; `peak_live` the largest sum of live blocks.
Small requests (<= 1 MiB, their own pool) are counted in peak_live only. A model: the real allocator
also rounds small segments and keeps per-stream pools (one stream here).
"""
import bisect
import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

MIB = 1 << 20
SMALL = MIB  # requests up to this go to the small pool
MIN_LARGE_ALLOC = 10 * MIB  # a new segment for a smaller request is LARGE_BUFFER
LARGE_BUFFER = 20 * MIB
ROUND_SEGMENT = 2 * MIB
MIN_BLOCK = 512
NORM_CHUNKS = 256  # row chunks of gpu_like_norms: a fixed count, so traces at two token counts pair up


@contextlib.contextmanager
def gpu_like_norms():
    """Within: eager F.rms_norm allocates only its output, as the GPU's fused kernel does. torch's CPU
    rms_norm is a float32 composite (two [rows, hidden] float32 temporaries), which put segments into a
    modelled pool that the GPU never makes (HunyuanOCR's merger norm: two 192 MiB ones on 8 pages). Rows
    are normalised in NORM_CHUNKS chunks, each a small-pool temporary; compiled code is left alone."""
    original = F.rms_norm

    def rms_norm(x, normalized_shape, weight=None, eps=None):
        rows = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
        if torch.compiler.is_compiling() or x.dim() < 2 or rows < NORM_CHUNKS:
            return original(x, normalized_shape, weight, eps)
        out = torch.empty_like(x)
        src, dst = x.reshape(rows, x.shape[-1]), out.view(rows, x.shape[-1])
        for i in range(NORM_CHUNKS):
            a, b = i * rows // NORM_CHUNKS, (i + 1) * rows // NORM_CHUNKS
            dst[a:b] = original(src[a:b], normalized_shape, weight, eps)
        return out

    F.rms_norm = rms_norm
    try:
        yield
    finally:
        F.rms_norm = original


def trace(fn) -> tuple[list[tuple[int, int]], object]:
    """([(alloc_id, bytes)] in order, bytes > 0 an allocation, < 0 the free of alloc_id), fn()'s result.
    Frees of memory allocated before fn() are dropped."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = []

    def walk(nodes):
        for node in nodes:
            if node.tag == torch._C._profiler._EventType.Allocation:
                events.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
            walk(node.children)

    walk(prof.profiler.kineto_results.experimental_event_tree())
    events.sort(key=lambda e: e[0])
    live, seq, next_id = {}, [], 0
    for _, ptr, nbytes in events:
        if nbytes > 0:
            live[ptr] = next_id
            seq.append((next_id, nbytes))
            next_id += 1
        elif ptr in live:
            seq.append((live.pop(ptr), nbytes))
    return seq, out


def extrapolate(small: list, large: list, n_small: int, n_large: int, n_full: int) -> list[tuple[int, int]]:
    """The trace at n_full tokens from the same forward's traces at n_small and n_large tokens, each
    event's size linear in the count (a size that shrinks with more tokens, a kernel's workspace sized by
    thread count, keeps the larger of its two values). Raises ValueError when the two traces differ in
    their events."""
    if len(small) != len(large) or any(a[0] != b[0] or (a[1] > 0) != (b[1] > 0) for a, b in zip(small, large)):
        raise ValueError(f"the traces at {n_small} and {n_large} tokens differ ({len(small)} vs {len(large)} "
                         f"events): the forward's allocations depend on the token count; use closer counts")
    out = []
    for (i, a), (_, b) in zip(small, large):
        slope = (b - a) / (n_large - n_small)
        size = round(a + slope * (n_full - n_small)) if slope * a > 0 else (max(a, b) if a > 0 else min(a, b))
        out.append((i, size))
    return out


@dataclasses.dataclass
class _Block:
    segment: int
    offset: int
    size: int
    free: bool


class CachingAllocatorModel:
    """See the module docstring. replay(seq) -> self; then .reserved, .peak_live, .segments."""

    def __init__(self):
        self.segments: list[list[_Block]] = []
        self.free_blocks: list[tuple[int, int, int]] = []  # sorted (size, segment, offset)
        self.reserved = self.live = self.peak_live = 0
        self.where: dict[int, _Block | int] = {}  # live allocation id -> its block (small: its size)

    def replay(self, seq: list[tuple[int, int]]) -> "CachingAllocatorModel":
        """Apply (alloc_id, bytes) events in order (see `trace`); may be called again with more events."""
        where = self.where
        for alloc_id, nbytes in seq:
            if nbytes > 0:
                size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
                self.live += size
                self.peak_live = max(self.peak_live, self.live)
                where[alloc_id] = self._malloc(size) if size > SMALL else size
            else:
                block = where.pop(alloc_id)
                if isinstance(block, int):
                    self.live -= block
                else:
                    self.live -= block.size
                    self._free(block)
        return self

    def _malloc(self, size: int) -> _Block:
        i = bisect.bisect_left(self.free_blocks, (size, -1, -1))
        if i == len(self.free_blocks):  # nothing fits: a new segment
            seg_size = LARGE_BUFFER if size < MIN_LARGE_ALLOC else -(-size // ROUND_SEGMENT) * ROUND_SEGMENT
            self.reserved += seg_size
            self.segments.append([_Block(len(self.segments), 0, seg_size, True)])
            block = self.segments[-1][0]
        else:
            _, seg, off = self.free_blocks.pop(i)
            block = next(b for b in self.segments[seg] if b.offset == off)
        block.free = False
        if block.size - size > SMALL:  # split: the rest stays free
            rest = _Block(block.segment, block.offset + size, block.size - size, True)
            blocks = self.segments[block.segment]
            blocks.insert(blocks.index(block) + 1, rest)
            block.size = size
            bisect.insort(self.free_blocks, (rest.size, rest.segment, rest.offset))
        return block

    def _free(self, block: _Block) -> None:
        blocks = self.segments[block.segment]
        i = blocks.index(block)
        block.free = True
        for j in (i + 1, i - 1):  # merge with free neighbours (next first, so i stays valid)
            if 0 <= j < len(blocks) and blocks[j].free:
                other = blocks[j]
                self.free_blocks.remove((other.size, other.segment, other.offset))
                first, second = (block, other) if j > i else (other, block)
                first.size += second.size
                blocks.remove(second)
                block = first
        bisect.insort(self.free_blocks, (block.size, block.segment, block.offset))
