"""How many distinct packings (grid lists: the CUDA graph key) the server's batcher produces under a
closed-loop load, with and without size buckets, and how many calls a CudaGraphCache (warm-up 1,
8 graphs kept) would replay. Runs the real Batcher with a stand-in tower that sleeps (no GPU).

    python benchmarks/serve_packings.py --clients 64 --sizes 448 --seconds 10

The stand-in tower takes `--call-ms` + `--image-ms` per image (defaults: a 448px Qwen2.5-VL-7B call
on one H200 at 354 img/s for 32 images, mmenc bench); each client waits `--client-ms` between an
answer and its next image (render, HTTP, preprocessing)."""
import argparse
import collections
import json
import threading
import time

import torch

from mmenc.models.base import TowerOutput
from mmenc.serving.batcher import Batcher, Job
from mmenc.serving.metrics import ServeMetrics


def graph_outcomes(packings: list[tuple], warmup: int = 1, max_graphs: int = 8) -> collections.Counter:
    """Replays what CudaGraphCache would do for this sequence of keys (eager / captures / replays)."""
    seen, graphs, out = collections.Counter(), collections.OrderedDict(), collections.Counter()
    for key in packings:
        if key in graphs:
            graphs.move_to_end(key)
            out["replays"] += 1
            continue
        seen[key] += 1
        if seen[key] <= warmup:
            out["eager"] += 1
            continue
        graphs[key] = True
        out["captures"] += 1
        if len(graphs) > max_graphs:
            graphs.popitem(last=False)
    return out


def run(args, bucket: bool) -> dict:
    order: list[tuple] = []

    def tower(pixel_values, grid_thw, return_extras=True):
        order.append(tuple(tuple(g) for g in grid_thw.tolist()))
        time.sleep((args.call_ms + args.image_ms * grid_thw.shape[0] * 1.0) / 1000)
        return TowerOutput(torch.zeros(int(grid_thw.prod(-1).sum()) // 4, 4))

    batcher = Batcher(tower, lambda g: (g.prod(-1) // 4).tolist(), args.max_batch_patches, args.max_wait_ms,
                      ServeMetrics(), bucket=bucket)
    grids = [torch.tensor([[1, s // 14, s // 14]]) for s in args.sizes]
    stop, done = threading.Event(), [0]

    def client(i: int) -> None:
        k = i
        while not stop.is_set():
            grid = grids[k % len(grids)]
            k += 1
            batcher.submit(Job(torch.zeros(int(grid.prod()), 1, dtype=torch.uint8), grid)).result()
            done[0] += 1
            time.sleep(args.client_ms / 1000)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.seconds)
    stop.set()
    for t in threads:
        t.join()
    span = time.perf_counter() - start
    batcher.close(timeout=30)
    outcomes = graph_outcomes(order)
    return {"bucket": bucket, "calls": len(order), "packings": len(set(order)),
            "mean_images": round(sum(len(p) for p in order) / max(len(order), 1), 2),
            "images_per_s": round(done[0] / span, 1), **{k: outcomes[k] for k in ("eager", "captures", "replays")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--sizes", type=int, nargs="+", default=[448], help="square image sides, cycled per client")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--call-ms", type=float, default=5.0)
    p.add_argument("--image-ms", type=float, default=2.7)
    p.add_argument("--client-ms", type=float, default=30.0)
    p.add_argument("--max-batch-patches", type=int, default=32768)
    p.add_argument("--max-wait-ms", type=float, default=5.0)
    args = p.parse_args()
    for bucket in (False, True):
        print(json.dumps(run(args, bucket)), flush=True)


if __name__ == "__main__":
    main()
