"""CUDA graphs of whole tower forwards, one per packing (`MultiModalConfig(cuda_graphs=True)`).

A tower forward launches hundreds of kernels; for a packing seen before, replaying a captured graph
launches them all at once from the GPU's side, with no Python or launch overhead in between.

The key is the whole packing: (grid_thw rows, pixel dtype, features per patch, device). A graph
captured for one split of N tokens is never replayed for another split of the same N, since the
attention segments (cu_seqlens) differ even when every tensor shape is the same.

Life of a key:
- its first `warmup` calls run the tower normally: they fill the tower's per-grid plan caches
  (device tensors), compile blocks and tune kernels; none of that may happen inside a capture;
- the next call captures it on the cache's capture stream (without draining the GPU), then replays;
- every later call copies the input into the graph's static input buffer and replays.
Capture policy: a capture costs its host time (recording every launch) and some pool memory, so it
pays only for a packing that comes back. A sighting counts only if
the key's previous sighting was at most `recent_calls` calls of this cache ago (16 by default); an
older one starts the count again ("stale" in stats). Repeated `encode` calls of the same inputs see
each packing every few calls (one per chunk) and capture on their second call as before; a stream
of mixed sizes, whose packings recur by chance and far apart, no longer captures graphs it never
replays (run 9a: 4 captures, 0 replays in 600 images). 16 is twice max_graphs (8): a packing that
comes back only after more calls than that would mostly have been evicted again by the others
before its next replay. recent_calls=None: no recency condition (the rule before).
A key whose plan the tower has evicted since its last sighting (towers keep 8) runs eager once more
("replanned" in stats): a fresh plan lacks the tables forwards cache on it, and building those
copies from the host, which a capture cannot do (runs 14f-15f: 3 of 5 stream captures failed so).
A capture that fails (an operation that cannot be captured, e.g. a host copy) is logged once with
its reason, and that key then runs without a graph. Call counts and failures are kept for the
1,024 most recent packings without a graph, so a server seeing endless new sizes does not grow them.

Memory: all graphs of one cache share one memory pool; each keeps its own static input. Outputs are
copied out after every replay (the next replay of any graph may overwrite the pool), so results
are the caller's to keep. At most `max_graphs` graphs are kept (least recently used dropped).
"""
import collections
from collections.abc import Hashable

import torch
import torch.nn as nn

from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput
from mmenc.utils.lru import LRUCache

logger = init_logger(__name__)


class _Graph:
    """A captured forward. `plan`: the tower's per-grid plan the capture read (rotary tables,
    cu_seqlens, ...): the graph replays reads of those very tensors, so it holds them alive even after
    the tower's own plan cache has dropped them."""

    def __init__(self, graph: torch.cuda.CUDAGraph, static_in: torch.Tensor, static_out: TowerOutput, plan=None):
        self.graph, self.static_in, self.static_out, self.plan = graph, static_in, static_out, plan
        self.replays = 0  # replays after the capture call


class CudaGraphCache:
    """Runs `tower(pixel_values, grid_thw)` through one CUDA graph per packing (see the module doc).

    stats: counts of "eager" calls (warm-up or uncapturable), "captures", "replays", "stale" (sightings
    too long after the previous one to count), "replanned" (eager: the plan was evicted) and
    "dropped_unreplayed" (graphs evicted without a replay).
    unreplayed(): graphs captured and never replayed so far (kept or dropped).
    """

    def __init__(self, tower: nn.Module, device: torch.device | str, max_graphs: int = 8, warmup: int = 1,
                 recent_calls: int | None = 16):
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a CUDA device; the tower is on {device}. Leave cuda_graphs "
                             f"off on this platform")
        if max_graphs < 1 or warmup < 1:
            raise ValueError(f"max_graphs={max_graphs} and warmup={warmup} must both be >= 1")
        if recent_calls is not None and recent_calls < 1:
            raise ValueError(f"recent_calls={recent_calls} must be >= 1 (or None: capture whenever a packing "
                             f"was seen warmup times)")
        self.tower, self.device, self.max_graphs, self.warmup = tower, device, max_graphs, warmup
        self.recent_calls = recent_calls
        self._graphs: collections.OrderedDict[Hashable, _Graph] = collections.OrderedDict()
        # per packing not (yet) captured: [sightings, capture failed, call number of the last sighting];
        # bounded, as servers see many packings
        self._seen = LRUCache(1024)
        self._calls = 0
        self._pool = None
        self._stream = None  # the capture stream, made at the first capture
        self.stats = collections.Counter()

    def key(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple:
        grid = tuple(tuple(row) for row in torch.as_tensor(grid_thw).tolist())
        return grid, pixel_values.dtype, tuple(pixel_values.shape[1:]), pixel_values.device

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        key = self.key(pixel_values, grid_thw)
        self._calls += 1
        entry = self._graphs.get(key)
        if entry is None:
            seen = self._seen.get(key, lambda: [0, False, self._calls])
            if seen[0] and self.recent_calls is not None and self._calls - seen[2] > self.recent_calls:
                seen[0] = 0  # seen too long ago to predict a repeat: count again from here
                self.stats["stale"] += 1
            seen[0] += 1
            seen[2] = self._calls
            if seen[0] <= self.warmup or seen[1]:
                self.stats["eager"] += 1
                return self.tower(pixel_values, grid_thw)
            if hasattr(self.tower, "has_plan") and not self.tower.has_plan(grid_thw, pixel_values.device):
                # evicted since its last sighting: a fresh plan lacks what forwards cache on it (attention
                # tables, copied from the host, which a capture cannot do), so this call runs eager and
                # rebuilds them; the next sighting captures
                self.stats["eager"] += 1
                self.stats["replanned"] += 1
                return self.tower(pixel_values, grid_thw)
            entry = self._capture(key, pixel_values, grid_thw, seen)
            if entry is None:
                self.stats["eager"] += 1
                return self.tower(pixel_values, grid_thw)
        else:
            self._graphs.move_to_end(key)
            self.stats["replays"] += 1
            entry.replays += 1
        entry.static_in.copy_(pixel_values)
        entry.graph.replay()
        return entry.static_out.map(torch.clone)

    def clear(self) -> None:
        """Drop every graph and sighting, and the shared pool with them (its memory goes back to the
        allocator's cache once no graph holds it): the next calls start as a new cache would, except
        that the capture stream is kept. For measurements that must count one workload's pool alone
        (`mmenc bench` with several workloads)."""
        self._graphs.clear()
        self._seen.clear()
        self._pool = None

    def unreplayed(self) -> int:
        """Graphs captured and never replayed so far: each cost a capture and bought nothing."""
        return self.stats["dropped_unreplayed"] + sum(g.replays == 0 for g in self._graphs.values())

    def _capture(self, key: tuple, pixel_values: torch.Tensor, grid_thw: torch.Tensor, seen: list) -> _Graph | None:
        static_in = pixel_values.clone()
        # the cached plan (__call__ checked that it is), kept alive by the graph
        plan = self.tower.plan(grid_thw, static_in.device) if hasattr(self.tower, "plan") else None
        recorded = self._record(key, static_in, grid_thw)
        if recorded is None:
            seen[1] = True
            return None
        graph, static_out = recorded
        entry = self._graphs[key] = _Graph(graph, static_in, static_out, plan)
        self.stats["captures"] += 1
        if len(self._graphs) > self.max_graphs:
            _, dropped = self._graphs.popitem(last=False)
            self.stats["dropped_unreplayed"] += dropped.replays == 0
        logger.info("captured a CUDA graph for grid %s (%d graphs kept)", [list(g) for g in key[0]], len(self._graphs))
        return entry

    def _record(self, key: tuple, static_in: torch.Tensor, grid_thw: torch.Tensor):
        """The CUDA part: (graph, static output) of tower(static_in, grid_thw), or None (logged) if it
        cannot be captured.

        Not through `torch.cuda.graph`: its entry synchronizes the device and empties both caching
        allocators, the device's and the pinned host one, so a stream that captures now and then
        waited for the GPU to drain and re-allocated its pinned staging buffers after each capture
        (run 14b: a capture call took ~420 ms where the same packing ran in ~190 ms without one).
        Here the capture is recorded on this cache's own stream while the GPU still runs earlier
        work. The key has run `warmup` times already (plans, compiled code, kernel tuning settled);
        only the cache's first capture runs the tower once more on the capture stream first, so
        that stream's own lazy state (its cuBLAS workspace) exists before a capture."""
        current = torch.cuda.current_stream(self.device)
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(current)
            with torch.cuda.stream(self._stream):
                self.tower(static_in, grid_thw)
            current.wait_stream(self._stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        self._stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._stream):
                graph.capture_begin(pool=self._pool)
                try:
                    static_out = self.tower(static_in, grid_thw)
                finally:
                    graph.capture_end()
        except Exception as e:  # noqa: BLE001 - any failure to capture means: run this packing without a graph
            logger.warning("CUDA graph capture failed for grid %s (%s: %s); this packing runs without a graph",
                           [list(g) for g in key[0]], type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            return None
        current.wait_stream(self._stream)
        return graph, static_out
