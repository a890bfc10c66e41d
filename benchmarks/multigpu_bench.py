"""Images/s of the Qwen2.5-VL-7B tower (dummy weights, bf16) on 1 GPU vs N GPUs, data and weights modes.

    python benchmarks/multigpu_bench.py --out multigpu.json          # needs 2 CUDA devices

Configurations, each on both workloads (8x1036px = 8 x grid (1,74,74); 32x448px = 32 x (1,32,32)):
  1gpu-inproc-gpuinput   build_tower + run_tower in this process, pixel_values already on the GPU (compute only)
  1gpu-inproc            the same from CPU pixel_values (what Encoder does with tensor_parallel_size=1)
  1gpu-group             a WorkerGroup of 1 (the multi-process path's own overhead: inputs and outputs by CUDA IPC)
  {N}gpu-data            WorkerGroup of N, mm_encoder_tp_mode="data" (a replica per GPU, images split)
  {N}gpu-weights         WorkerGroup of N, mm_encoder_tp_mode="weights" (tower sharded over the GPUs)
Every row but the first is end to end as the Encoder runs it: CPU float32 pixel_values in, embeddings
on cuda:0 out (group rows: synchronous `run`, which copies each rank's images to its GPU and gathers
the outputs on cuda:0). `worker_ms` is the slowest rank's own time (its tower call, synchronized);
`caller_split_ms` splits the caller's time: inputs to the GPUs, waiting for the workers, outputs.
--compile compiles the blocks everywhere (torch.compile; the warm-up calls pay it). Timing: warm-up
calls, then the median of `--iters` calls (CUDA events in process; perf_counter around the
synchronous group call). Inputs are random (never zeros), generated once per workload.
A time budget (--budget-s, default 220 s) skips what would not fit, saying so.
Smoke test without GPUs: --device-type cpu --model TINY_CHECKPOINT_FOLDER --dtype float32
--workloads 1x8x8*3 (gloo workers, perf_counter timing).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch

from mmenc.bench.measure import WORKLOADS

PATCH_FEATURES = 3 * 2 * 14 * 14


def _inputs(grids, seed=0):
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), PATCH_FEATURES, generator=g), grid_thw


def _median_ms_group(group, pv, grid, warmup, iters):
    for _ in range(warmup):
        group.run(pv, grid)
    times, worker, caller = [], [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        group.run(pv, grid)
        times.append((time.perf_counter() - t0) * 1e3)
        worker.append(max(s["total_s"] for s in group.last_stats) * 1e3)
        caller.append(group.last_timing)
    split = {k: round(statistics.median(c[k] for c in caller), 2) for k in caller[0]}
    split["inputs_ms_all"] = [round(c["inputs_ms"], 1) for c in caller]
    return statistics.median(times), statistics.median(worker), split


def _row(workload, config, grids, ms, worker_ms=None, peak_gib=None):
    images, patches = len(grids), sum(t * h * w for t, h, w in grids)
    return {"workload": workload, "config": config, "images": images, "patches": patches, "ms": round(ms, 3),
            "images_per_s": round(images / ms * 1e3, 2), "patches_per_s": round(patches / ms * 1e3),
            "worker_ms": None if worker_ms is None else round(worker_ms, 3), "peak_gib": peak_gib}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--attn-backend", default=None)
    ap.add_argument("--compile", action="store_true", help="torch.compile the tower blocks (in every process)")
    ap.add_argument("--staging", default="auto", help="comma-separated WorkerGroup stagings to compare in data "
                    "mode (auto, pinned, device); the first is used for the other group rows")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=220.0)
    ap.add_argument("--device-type", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of this script")
    ap.add_argument("--workloads", default=None, help="grid specs instead of the standard workloads, e.g. 1x8x8*3")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    from mmenc.bench.measure import time_ms
    from mmenc.config import MultiModalConfig
    from mmenc.engine.tower import TowerRecipe, build_tower, run_tower
    from mmenc.parallel import WorkerGroup

    t_start = time.monotonic()
    cuda = args.device_type == "cuda"
    if cuda and torch.cuda.device_count() < args.gpus:
        sys.exit(f"--gpus {args.gpus} but {torch.cuda.device_count()} CUDA devices are visible")
    workloads = WORKLOADS
    if args.workloads:
        from mmenc.bench.measure import parse_grid_spec
        workloads = {spec: parse_grid_spec(spec) for spec in args.workloads.split(",")}
    dev0 = "cuda:0" if cuda else "cpu"
    mm = MultiModalConfig(mm_encoder_attn_backend=args.attn_backend, compile=args.compile)
    tower_args = dict(model=args.model, load_format="dummy", dtype=args.dtype, multimodal_config=mm)
    inputs = {name: _inputs(grids) for name, grids in workloads.items()}
    rows, skipped = [], []

    def over_budget(what, need_s):
        if time.monotonic() - t_start + need_s > args.budget_s:
            skipped.append(what)
            print(f"skipped {what}: the {args.budget_s:g}s budget would be exceeded", flush=True)
            return True
        return False

    # -- worker groups ----------------------------------------------------------------------
    stagings = args.staging.split(",")
    configs = [(1, "weights", "1gpu-group", stagings[0])]
    for mode in ("data", "weights"):
        resolved, reason = TowerRecipe(tower_args).tp_mode(mode, args.gpus)
        if reason:
            print(f"{args.gpus}gpu-{mode}: {reason}", flush=True)
        for staging in stagings if mode == "data" else stagings[:1]:
            suffix = f"-{staging}" if len(stagings) > 1 and mode == "data" else ""
            configs.append((args.gpus, resolved, f"{args.gpus}gpu-{mode}{suffix}", staging))
    for world, mode, label, staging in configs:
        if over_budget(label, 45):
            continue
        t0 = time.monotonic()
        extra = {"staging": staging} if cuda else {}
        with WorkerGroup(world, TowerRecipe(tower_args), mode=mode, device_type=args.device_type, timeout_s=120,
                         startup_timeout_s=150, **extra) as group:
            print(f"{label}: started in {time.monotonic() - t0:.0f}s", flush=True)
            for name, (pv, grid) in inputs.items():
                if over_budget(f"{label} {name}", 10):
                    continue
                ms, worker_ms, split = _median_ms_group(group, pv, grid, args.warmup, args.iters)
                rows.append({**_row(name, label, workloads[name], ms, worker_ms=worker_ms), "caller_split_ms": split})
                print(f"{label} {name}: {ms:.1f} ms; caller: inputs {split['inputs_ms']:.1f} ms "
                      f"(host {split.get('stage_ms', 0):.1f}, copy wait {split.get('copy_wait_ms', 0):.1f}), waiting "
                      f"for workers {split['workers_ms']:.1f} ms, outputs {split['outputs_ms']:.1f} ms", flush=True)

    # -- 1 GPU, in process (after the groups: a caller that ran torch.compile itself stages inputs slower) ---
    loaded = build_tower(**tower_args, device=dev0)
    with torch.inference_mode():
        for name, (pv, grid) in inputs.items():
            pv_gpu = pv.to(dev0)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            ms = time_ms(lambda: run_tower(loaded, pv_gpu, grid), torch.device(args.device_type), args.warmup, args.iters)
            peak = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
            rows.append(_row(name, "1gpu-inproc-gpuinput", workloads[name], ms, peak_gib=peak))
            ms = time_ms(lambda: run_tower(loaded, pv, grid), torch.device(args.device_type), args.warmup, args.iters)
            rows.append(_row(name, "1gpu-inproc", workloads[name], ms))
            del pv_gpu
            print(f"{name}: 1 GPU in process done ({time.monotonic() - t_start:.0f}s)", flush=True)
    del loaded
    if cuda:
        torch.cuda.empty_cache()

    # -- report -----------------------------------------------------------------------------
    order = {"1gpu-inproc-gpuinput": 0, "1gpu-inproc": 1}
    rows.sort(key=lambda r: order.get(r["config"], 2))  # measured last, shown first
    base = {r["workload"]: r["images_per_s"] for r in rows if r["config"] == "1gpu-inproc"}
    print(f"\n{'workload':<10} {'config':<24} {'ms':>9} {'worker ms':>10} {'images/s':>9} {'patches/s':>11} "
          f"{'vs 1gpu':>8}")
    for r in rows:
        r["speedup_vs_1gpu_inproc"] = round(r["images_per_s"] / base[r["workload"]], 3) if r["workload"] in base \
            else None
        wm = f"{r['worker_ms']:.1f}" if r["worker_ms"] is not None else "-"
        print(f"{r['workload']:<10} {r['config']:<24} {r['ms']:>9.1f} {wm:>10} {r['images_per_s']:>9.1f} "
              f"{r['patches_per_s']:>11,} {r['speedup_vs_1gpu_inproc'] or 0:>7.2f}x")
    if skipped:
        print(f"skipped: {', '.join(skipped)}")
    result = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"), "gpu": torch.cuda.get_device_name(0) if cuda else "cpu",
        "gpus": args.gpus, "torch": torch.__version__, "model": args.model, "dtype": args.dtype,
        "attn_backend": args.attn_backend, "compile": args.compile, "warmup": args.warmup, "iters": args.iters,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "rows": rows, "skipped": skipped,
        "wall_s": round(time.monotonic() - t_start, 1)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    print(f"total {result['wall_s']}s")


if __name__ == "__main__":
    main()
