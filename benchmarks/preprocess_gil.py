"""How much of the GIL the calling thread keeps while workers decode a JPEG stream: worker threads
vs worker processes (Preprocessor(worker_kind=...), issue 11). CPU only.

    PYTHONPATH=. python benchmarks/preprocess_gil.py [--images 240] [--workers 1 2 4] [--reps 3] [--json PATH]

It stands in for the GPU stream (Encoder.encode_iter with a compiled tower, where the calling thread
launches the tower from Python): the calling thread is a launcher that always has Python work (a busy
loop in slices of 2,000 additions, standing in for kernel launches). Between slices it keeps
2 x workers images submitted, takes the prepared ones in input order and copies each into host memory
as the CUDA staging does (`staging.pinned_copy`: numpy, decoded layout kept; pinned where CUDA is
available), giving a worker process's segment back. The workers do what they do for a CUDA device:
decode, probe, plan (resize="device"; `--resize cpu` adds the CPU resize), on mixed-size JPEG files
(paths) of 200..1036 px. Process startup is excluded (a warm-up round first).

Reported per mode and worker count (median of --reps, modes interleaved): `loop`: the busy loop's
speed while the stream runs, relative to the loop alone (1.0: the launcher lost nothing; on a
loaded machine CPU contention lowers it too); `img/s`; `take ms/img`: calling-thread wall time per image
spent submitting, taking and copying (`cpu`: its CPU time, which preemption does not inflate); `own cpu`: the calling thread's CPU time / wall time (it always
has work, so what it misses it spent waiting for the GIL or for a core); `others ms/img`: CPU time of
the calling process's other threads per image (threads: the workers, whose Python parts hold the
GIL; processes: the receiver thread only), which does not depend on the machine's load; `GIL wait`:
the share of the wall time the calling thread was blocked, neither on a CPU nor waiting for one
(Linux schedstat: wall - on-CPU - run-queue wait), i.e. waiting for the GIL, and that per image. `--pickle-check`
also times pickling a decoded 1036 px PIL image / array against loading it (why in-memory inputs
stay in threads).
"""
import argparse
import collections
import dataclasses
import json
import math
import pathlib
import pickle
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from mmenc.bench.e2e import write_jpegs
from mmenc.preprocess import get_processor
from mmenc.preprocess.images import load_image
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.procs import ProcessWorkers
from mmenc.preprocess.staging import pinned_copy

SLICE = 2000


def busy(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def schedstat() -> tuple[float, float]:
    """The calling thread's (seconds on a CPU, seconds runnable but waiting for a CPU) from Linux's
    /proc/self/task/TID/schedstat; (nan, nan) elsewhere. Wall time minus both is time it was blocked:
    here, waiting for the GIL."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            on_cpu, run_wait, _ = f.read().split()
    except OSError:
        return math.nan, math.nan
    return int(on_cpu) / 1e9, int(run_wait) / 1e9


def loop_alone(seconds: float = 1.0) -> float:
    """The busy loop's iterations/s with nothing else running in this process."""
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        busy(SLICE)
        iters += SLICE
    return iters / (time.perf_counter() - start)


def stream(kind: str, workers: int, work, paths: list[str]) -> dict:
    if kind == "process":
        pool = ProcessWorkers(work, workers)
        submit, close = pool.submit, pool.close
    else:
        threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="bench-worker")
        submit, close = (lambda i, item: threads.submit(work.prepare, i, item)), threads.shutdown
    try:
        for fut in [submit(i, p) for i, p in enumerate(paths[:2 * workers])]:  # warm-up: processes started
            if fut.result().release is not None:
                fut.result().release()
        pending: collections.deque = collections.deque()
        nxt = done = iters = 0
        busy_s = take_s = take_cpu = 0.0
        start, cpu0, own0, sched0 = time.perf_counter(), time.process_time(), time.thread_time(), schedstat()
        while done < len(paths):
            t, c = time.perf_counter(), time.thread_time()
            while len(pending) < 2 * workers and nxt < len(paths):
                pending.append(submit(nxt, paths[nxt]))
                nxt += 1
            if pending and pending[0].done():
                ready = pending.popleft().result()
                pinned_copy(ready.pixels)
                if ready.release is not None:
                    ready.release()
                done += 1
                take_s, take_cpu = take_s + time.perf_counter() - t, take_cpu + time.thread_time() - c
            else:
                take_s, take_cpu = take_s + time.perf_counter() - t, take_cpu + time.thread_time() - c
                t = time.perf_counter()
                busy(SLICE)
                busy_s += time.perf_counter() - t
                iters += SLICE
        wall = time.perf_counter() - start
        sched = schedstat()
        blocked = wall - (sched[0] - sched0[0]) - (sched[1] - sched0[1])
        own = time.thread_time() - own0
        others = time.process_time() - cpu0 - own  # CPU of this process's other threads (workers, receiver)
    finally:
        close()
    return {"loop_per_s": iters / max(busy_s, 1e-9), "images_per_s": len(paths) / wall,
            "take_ms_per_image": 1e3 * take_s / len(paths), "take_cpu_ms_per_image": 1e3 * take_cpu / len(paths), "own_cpu_share": own / wall,
            "others_cpu_ms_per_image": 1e3 * others / len(paths), "gil_wait_share": blocked / wall,
            "gil_wait_ms_per_image": 1e3 * blocked / len(paths), "wall_s": wall}


def pickle_check() -> dict:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (34, 34, 3), dtype=np.uint8)
    array = np.asarray(Image.fromarray(small).resize((1036, 1036), Image.BICUBIC))
    out = {}
    for name, item in (("PIL 1036px", Image.fromarray(array)), ("array 1036px", array)):
        t = time.perf_counter()
        for _ in range(10):
            pickle.loads(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL))
        cross = (time.perf_counter() - t) / 10
        t = time.perf_counter()
        for _ in range(10):
            load_image(item)
        load = (time.perf_counter() - t) / 10
        out[name] = {"pickle_roundtrip_ms": 1e3 * cross, "load_image_ms": 1e3 * load}
        print(f"{name}: pickle+unpickle {1e3 * cross:.2f} ms (what crossing to a process costs, at least) vs "
              f"load_image {1e3 * load:.2f} ms (the work a process would take over)")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=240)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--resize", choices=["device", "cpu"], default="device")
    ap.add_argument("--model", default="qwen2_5_vl")
    ap.add_argument("--pickle-check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)  # the workers' resize runs one image per worker (as in the worker processes)
    rng = np.random.default_rng(11)
    sizes = [tuple(int(x) for x in rng.integers(200, 1037, 2)) for _ in range(48)]
    result: dict = {"images": args.images, "resize": args.resize, "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory(prefix="mmenc-gil-") as tmp:
        files = write_jpegs(pathlib.Path(tmp), sizes, seed=3)
        paths = [files[i % len(files)] for i in range(args.images)]
        pre = Preprocessor(get_processor(args.model), device="cpu", workers=1)  # for its decode choice only
        work = dataclasses.replace(pre.work, resize=args.resize, device_type="cuda")
        alone = statistics.median(loop_alone() for _ in range(3))
        result["loop_alone_per_s"] = alone
        print(f"decode={work.decode} resize={work.resize}; busy loop alone: {alone / 1e6:.1f} M iterations/s")
        print(f"{'mode':8} {'workers':>7} {'loop':>6} {'img/s':>7} {'take ms/img':>11} {'cpu':>5} {'own cpu':>7} "
              f"{'others ms/img':>13} {'GIL wait':>8} {'GIL ms/img':>10}")
        for workers in args.workers:
            runs: dict[str, list[dict]] = {"thread": [], "process": []}
            for _ in range(args.reps):
                for kind in runs:
                    runs[kind].append(stream(kind, workers, work, paths))
            for kind, got in runs.items():
                row = {"mode": kind, "workers": workers,
                       **{k: statistics.median(r[k] for r in got) for k in got[0]}}
                row["loop_vs_alone"] = row["loop_per_s"] / alone
                result["rows"].append(row)
                print(f"{kind:8} {workers:7d} {row['loop_vs_alone']:6.2f} {row['images_per_s']:7.1f} "
                      f"{row['take_ms_per_image']:11.3f} {row['take_cpu_ms_per_image']:5.3f} {row['own_cpu_share']:7.2f} "
                      f"{row['others_cpu_ms_per_image']:13.2f} {row['gil_wait_share']:8.2f} "
                      f"{row['gil_wait_ms_per_image']:10.2f}", flush=True)
    if args.pickle_check:
        result["pickle_check"] = pickle_check()
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
