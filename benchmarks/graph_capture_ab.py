"""GPU only. A/B: replay speed of graphs captured by the new _record (own stream, no sync/empty caches) vs the old
one (side-stream warm-up, then torch.cuda.graph: a device sync and emptied device and pinned-host
caches before each capture), and the time of a capture call. Same compiled Qwen2.5-VL-7B tower (random
weights, bf16), a fresh cache per variant, alternated twice. Run from the repository root:
    python benchmarks/graph_capture_ab.py
"""
import argparse
import sys
import time

import torch

from mmenc.engine.cuda_graphs import CudaGraphCache
from mmenc.engine.encoder import Encoder


def old_record(self, key, static_in, grid_thw):
    side = torch.cuda.Stream(self.device)
    side.wait_stream(torch.cuda.current_stream(self.device))
    with torch.cuda.stream(side):
        self.tower(static_in, grid_thw)
    torch.cuda.current_stream(self.device).wait_stream(side)
    if self._pool is None:
        self._pool = torch.cuda.graph_pool_handle()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=self._pool):
        out = self.tower(static_in, grid_thw)
    return g, out


def timed(fn, n):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_capture_ab.py: needs a CUDA device", file=sys.stderr)
        return 2
    enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy", dtype="bfloat16", device="cuda", compile=True, cuda_graphs=True)
    tower = enc.tower  # compiled; the tower its own CudaGraphCache runs
    work = {"8x1036px": [[1, 74, 74]] * 8, "32x448px": [[1, 32, 32]] * 32}
    inputs = {k: (torch.randn(sum(t * h * w for t, h, w in g), 1176, device="cuda", dtype=torch.bfloat16), torch.tensor(g))
              for k, g in work.items()}

    with torch.inference_mode():
        for k, (pv, g) in inputs.items():  # compile + eager reference
            for _ in range(2):
                tower(pv, g)
            print(f"{k} eager compiled {timed(lambda: tower(pv, g), 5):.2f} ms", flush=True)
        for variant in ("new", "old", "new", "old"):
            cache = CudaGraphCache(tower, "cuda")
            if variant == "old":
                cache._record = old_record.__get__(cache)
            for k, (pv, g) in inputs.items():
                cache(pv, g)  # eager sighting
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cache(pv, g)  # capture + replay
                torch.cuda.synchronize()
                cap = (time.perf_counter() - t0) * 1e3
                ms = timed(lambda: cache(pv, g), 10)
                print(f"{variant:<4} {k:<9} capture call {cap:7.1f} ms   replay {ms:7.2f} ms   {dict(cache.stats)}", flush=True)
            cache = None
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
