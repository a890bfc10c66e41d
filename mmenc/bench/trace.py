"""Where the wall time of Encoder calls goes (`mmenc bench --e2e`: the stream and one traced encode).

    with TowerTrace(encoder) as trace:
        encoder.encode(paths)
    report = trace.report()     # tower calls, gaps between them, lead-in, graph path, host seconds

On CUDA each tower call (through `Encoder.tower_call_hook`) is bracketed by two CUDA events on the current stream,
so its span is the device's time from the call's first kernel to its last, and the gap before call
k+1 is the device time between the end of call k and the start of call k+1: idle, or the
preprocessing kernels of the next chunk (resize, normalise, which run on the same stream). Lead-in:
from the trace's start (the device idle, the host starting the call) to the first tower kernel;
tail: from the last tower kernel to the trace's end. On the CPU the same from the host clock.
Host seconds come from the Encoder's and the Preprocessor's Tally (mmenc.tally): chunk_wait_s (the
calling thread waiting for a chunk: worker_wait_s blocked on the decode/resize threads, stage_s
copying and finishing it), launch_s (queueing tower calls), device_wait_s (reading finite flags:
the host ahead by the in-flight bound), consumer_s (the caller's loop body between results).
Nothing here is imported by the engine.
"""
import dataclasses
import time

import torch

GAP_REPORTED_MS = 1.0  # gaps longer than this are counted apart ("gaps_over_1ms")


@dataclasses.dataclass
class _Call:
    grid: list
    graph: str  # "eager", "capture", "replay" or "-" (no graph cache)
    start: object  # torch.cuda.Event, or perf_counter seconds on the CPU
    end: object


class TowerTrace:
    """Context manager: records every tower call of `encoder` while open (see the module doc)."""

    def __init__(self, encoder):
        self.encoder = encoder
        self.cuda = encoder.device.type == "cuda"
        self.calls: list[_Call] = []
        self._hook = None

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def __enter__(self):
        self._sync()
        self._tallies = (self.encoder.tally.snapshot(), self.encoder.preprocessor.tally.snapshot())
        self._graph_stats = self.encoder.graph_stats() or {}
        self._unreplayed = self.encoder.unreplayed_graphs()

        def traced(run, pixel_values, grid_thw):
            before = self.encoder.graph_stats()
            start = self._mark()
            out = run(pixel_values, grid_thw)
            end = self._mark()
            after = self.encoder.graph_stats()
            path = "-" if before is None else next(
                (k for k in ("replays", "captures", "eager") if after.get(k, 0) > before.get(k, 0)), "-")
            self.calls.append(_Call(torch.as_tensor(grid_thw).tolist(), path.removesuffix("s"), start, end))
            return out

        self._hook = self.encoder.tower_call_hook(traced)
        self._hook.__enter__()
        self._wall = time.perf_counter()
        self._begin = self._mark()
        return self

    def __exit__(self, *exc):
        self._end = self._mark()
        self._sync()
        self.wall_s = time.perf_counter() - self._wall
        self._hook.__exit__(*exc)
        enc_host = self.encoder.tally.since(self._tallies[0])
        pre_host = self.encoder.preprocessor.tally.since(self._tallies[1])
        self.host_s = {k: v for k, v in {**enc_host, **pre_host}.items() if k.endswith("_s")}

    def report(self) -> dict:
        """The trace as a JSON-ready dict (times in ms unless named _s); after the `with` block."""
        spans = [self._ms(c.start, c.end) for c in self.calls]
        gaps = [self._ms(a.end, b.start) for a, b in zip(self.calls, self.calls[1:])]
        report = {"wall_ms": self.wall_s * 1e3, "tower_calls": len(self.calls), "tower_ms": sum(spans),
                  "busy_fraction": sum(spans) / 1e3 / max(self.wall_s, 1e-9),
                  "lead_in_ms": self._ms(self._begin, self.calls[0].start) if self.calls else None,
                  "tail_ms": self._ms(self.calls[-1].end, self._end) if self.calls else None,
                  "gaps_ms_sum": sum(gaps), "gaps_ms_max": max(gaps, default=0.0),
                  "gaps_over_1ms": sum(g > GAP_REPORTED_MS for g in gaps), "host_s": self.host_s,
                  "calls": [{"images": len(c.grid), "patches": patches_of(c.grid), "ms": ms,
                             "gap_before_ms": gaps[i - 1] if i else None, "graph": c.graph}
                            for i, (c, ms) in enumerate(zip(self.calls, spans))]}
        stats = self.encoder.graph_stats()
        if stats is not None:
            report["graph_calls"] = {k: v - self._graph_stats.get(k, 0) for k, v in stats.items()}
            report["graph_calls"]["unreplayed"] = self.encoder.unreplayed_graphs() - self._unreplayed
        return report

    def grids(self) -> list[list]:
        return [c.grid for c in self.calls]

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.encoder.device)


def patches_of(grid: list[list]) -> int:
    """The patch rows of one call's grid_thw rows [t, h, w, ...] (LLaVA-NeXT's rows add columns after them)."""
    return sum(row[0] * row[1] * row[2] for row in grid)


def tower_only_ms(encoder, grids: list[list], features: int) -> float:
    """Wall ms of the tower alone over the same packings (`grids`, one per call), back to back with
    one synchronisation at the end, random pixels, without CUDA graphs (what a stream of packings that
    never repeat can at best do): the rate the stream's wall time should approach."""
    rows = max((patches_of(g) for g in grids), default=0)
    if not rows:
        return 0.0
    buffer = torch.randn(rows, features, device=encoder.input_device)
    with encoder.graphs_off():
        sync = torch.cuda.synchronize if encoder.device.type == "cuda" else (lambda *a: None)
        sync()
        begin = time.perf_counter()
        for g in grids:
            encoder.launch(buffer[:patches_of(g)], torch.tensor(g))
        sync()
        return (time.perf_counter() - begin) * 1e3


def format_trace(label: str, r: dict) -> str:
    """Two lines: the device's side (tower, gaps, lead-in, graphs) and the host's seconds."""
    graphs = r.get("graph_calls") or {}
    shown = ", ".join(f"{k} {v}" for k, v in graphs.items() if v) or "none"
    host = ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.1f}" for k, v in r["host_s"].items())
    return (f"{label}: wall {r['wall_ms']:.1f} ms = lead-in {r['lead_in_ms'] or 0:.1f} + {r['tower_calls']} tower calls "
            f"{r['tower_ms']:.1f} + gaps {r['gaps_ms_sum']:.1f} (largest {r['gaps_ms_max']:.1f}, "
            f"{r['gaps_over_1ms']} over 1 ms) + tail {r['tail_ms'] or 0:.1f}; busy {100 * r['busy_fraction']:.0f}%; "
            f"images per call {[c['images'] for c in r['calls']]}; graphs: {shown}\n"
            f"{label} host ms: {host}")
