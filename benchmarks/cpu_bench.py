"""The CPU table: mmenc's tower beside transformers' and vLLM's CPU tower, same weights, same pixels.

    python benchmarks/cpu_bench.py [--workload qwen-4x448 qwen-1x1036 siglip-8x384] [--dtype float32 bfloat16]
        [--rounds 3] [--vllm-python /work/venvs/vllm-cpu-bench/bin/python] [--impls mmenc,native,compile,hf,vllm]
        [--threads N] [--layers N] [--op-profile] [--json out.json]

Weights: transformers' tower with the published init scale (mmenc.testing.random_weights: normal(0, 0.02)
matrices), the same tensors loaded into mmenc and sent to vLLM. Each round calls every implementation
once, in turn (A/B/C alternating in one run, so a load change on a shared machine hits all of them);
the table gives the median and range of the rounds and the load average (uptime) around them.
Time: wall seconds and the process's CPU seconds (user + sys, all threads; the vLLM child's own) of each
call, with OMP_WAIT_POLICY=passive (set here unless given) so that waiting threads sleep rather than spin:
on a shared machine the CPU time is the steadier measure, the wall time says what a user waits.
--layers N: the towers cut to their first N blocks (Qwen2.5-VL keeps its full-attention blocks below N,
else its last block attends whole frames), for iterating; the merger/head stays. --op-profile: one more
call of each implementation under mmenc.bench.op_cpu_time (CPU seconds per operator). Outputs:
relative error against transformers in the same dtype; with both dtypes, each image's cosine of the
bfloat16 output against the float32 one (the bf16 bar: >= 0.999). Memory: the bytes the tower's weights
take in mmenc (packed linears as packed) against the checkpoint's tower tensors in that dtype.
Impls: mmenc (the platform's linear backend, ONEDNN on x86), native (mmenc with linear_backend="native"),
compile (mmenc with compile=True), hf (transformers, sdpa), vllm (vLLM's tower; needs --vllm-python).
SigLIP: pooled embeddings (the attention-pooling head included) on both sides.
"""
import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")  # before torch loads OpenMP; the vLLM child inherits it

import torch  # noqa: E402

from mmenc.bench.hf_reference import build_hf_tower  # noqa: E402
from mmenc.bench.measure import cut_model, parse_grid_spec  # noqa: E402
from mmenc.bench.op_cpu_time import OpCpuTime, process_cpu_seconds  # noqa: E402
from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.layers.linear_kernels import linear_states_nbytes  # noqa: E402
from mmenc.testing.random_weights import init_comparable_weights_  # noqa: E402

WORKLOADS = {  # name -> (model, grids)
    "qwen-4x448": ("Qwen/Qwen2.5-VL-7B-Instruct", [(1, 32, 32)] * 4),
    "qwen-1x1036": ("Qwen/Qwen2.5-VL-7B-Instruct", [(1, 74, 74)]),
    "siglip-8x384": ("google/siglip-so400m-patch14-384", [(1, 27, 27)] * 8),
}


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


def timed(fn):
    """fn() -> output  to  () -> (wall s, CPU s, output); with ops (an OpCpuTime) the call runs under it."""
    def call(ops=None):
        start, cpu = time.perf_counter(), process_cpu_seconds()
        if ops is None:
            out = fn()
        else:
            with ops:
                out = fn()
        return time.perf_counter() - start, process_cpu_seconds() - cpu, out
    return call


def build(model: str, dtype: str, impls: list[str], vllm_python: str | None, threads: int, px, grid):
    """{impl: callable(ops=None) -> (wall s, CPU s, output)} over one set of weights, on (px, grid)."""
    base = Encoder(model, device="cpu", dtype=dtype, load_format="dummy")
    hf = build_hf_tower(base.loaded)
    init_comparable_weights_(hf.module)
    state = {n: t for n, t in hf.module.state_dict().items() if "inv_freq" not in n}
    pooled = hasattr(base.tower, "pool")
    calls, memory = {}, {}
    for impl in impls:
        if impl in ("mmenc", "native", "compile"):
            enc = base if impl == "mmenc" else Encoder(model, device="cpu", dtype=dtype, load_format="dummy",
                                                       linear_backend="native" if impl == "native" else None,
                                                       compile=impl == "compile")
            enc.tower.load_weights(state.items())
            def encode(enc=enc):
                return enc.encode_pixels(px, grid, pooled=pooled)
            calls[f"{impl} ({enc.linear_backend()})"] = timed(encode)
            memory[impl] = linear_states_nbytes(enc.tower)
        elif impl == "hf":
            calls["transformers"] = timed(_hf_call(hf, pooled, px, grid))
        elif impl == "vllm" and vllm_python:
            from mmenc.bench.vllm_cpu import VllmTower

            tower = VllmTower(vllm_python, base.loaded.hf_config, state, base.dtype, threads)
            calls["vllm"] = _vllm_call(tower, px, grid)
    tensors = sum(t.nbytes for t in state.values())
    return calls, {"checkpoint_tower_bytes": tensors, **{f"{k}_weight_bytes": v for k, v in memory.items()}}


def _vllm_call(tower, px, grid):
    """The child's own wall and CPU seconds; with ops, its per-operator CPU seconds merged into ops.stats."""
    def call(ops=None):
        seconds, out, info = tower.run_timed(px, grid, keep_output=True, profile=ops is not None)
        for name, entry in info.get("ops", {}).items():
            ops.stats[name] = [entry["calls"], entry["cpu_s"]]
        return seconds, info["cpu_s"], out
    return call


def _hf_call(hf, pooled: bool, px, grid):
    if not pooled:
        return lambda: hf(px, grid)
    images = hf.inputs(px, grid)

    def call():  # transformers' pooler_output: the same attention-pooling head
        hf.module.use_head = True
        with torch.inference_mode():
            return torch.cat([hf.module(pixel_values=i, interpolate_pos_encoding=True).pooler_output for i in images])
    return call


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", nargs="+", default=["qwen-4x448", "qwen-1x1036"], choices=sorted(WORKLOADS))
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--impls", default="mmenc,hf,vllm")
    p.add_argument("--vllm-python", default=None, help="python of a virtualenv with vLLM's CPU build")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--grid", default=None, metavar="TxHxW[*N]", help="replace the workloads' grids (a quick check)")
    p.add_argument("--layers", type=int, default=None, help="cut the towers to their first N blocks (iterating)")
    p.add_argument("--op-profile", action="store_true", help="one more call each: CPU seconds per operator")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results, fp32_out = [], {}
    for name in args.workload:
        model, grids = WORKLOADS[name]
        grids = parse_grid_spec(args.grid) if args.grid else grids
        for dtype in args.dtype:
            with tempfile.TemporaryDirectory(prefix="mmenc-cpu-bench-") as folder:
                row = run_workload(args, name, cut_model(model, args.layers, folder), grids, dtype, fp32_out)
            results.append(row)
            _print(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                       "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "layers": args.layers,
                       "results": results}, f, indent=1)


def run_workload(args, name: str, model: str, grids, dtype: str, fp32_out: dict) -> dict:
    grid = torch.tensor(grids)
    family = WORKLOADS[name][0]  # `model` may be a cut copy's folder
    px = torch.randn(int(grid.prod(-1).sum()), _features(family), generator=torch.Generator().manual_seed(0))
    calls, memory = build(model, dtype, args.impls.split(","), args.vllm_python, args.threads, px, grid)
    wall, cpu = {k: [] for k in calls}, {k: [] for k in calls}
    outs = {k: fn()[2].float() for k, fn in calls.items()}  # warm-up, and the outputs compared
    loads = [load()]
    for _ in range(args.rounds):
        for impl, fn in calls.items():
            seconds, cpu_s, _ = fn()
            wall[impl].append(seconds)
            cpu[impl].append(cpu_s)
        loads.append(load())
    row = {"workload": name, "dtype": dtype, "threads": args.threads, "layers": args.layers, "loadavg": loads,
           **memory, "impls": {k: {"median_s": statistics.median(wall[k]), "min_s": min(wall[k]),
                                   "max_s": max(wall[k]), "runs_s": wall[k], "cpu_median_s": statistics.median(cpu[k]),
                                   "cpu_min_s": min(cpu[k]), "cpu_max_s": max(cpu[k]), "cpu_runs_s": cpu[k]}
                               for k in calls}}
    if args.op_profile:
        for impl, fn in calls.items():
            ops = OpCpuTime()
            fn(ops)
            row["impls"][impl]["ops"] = ops.as_dict()
    ref = outs.get("transformers")
    for impl, out in outs.items():
        if ref is not None and impl != "transformers":
            row["impls"][impl]["rel_err_vs_transformers"] = _rel(out, ref)
    ours = next(iter(outs.values()))
    if dtype == "float32":
        fp32_out[name] = ours
    elif name in fp32_out:
        row["cosine_vs_fp32_min"] = _cosines(ours, fp32_out[name], grids, family)
    return row


def _features(model: str) -> int:
    return 3 * 14 * 14 * (2 if "Qwen" in model else 1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _cosines(out: torch.Tensor, ref: torch.Tensor, grids, model: str) -> float:
    """The smallest per-image cosine of `out` against `ref` (rows per image: tokens, or one pooled row)."""
    rows = [1] * len(grids) if out.shape[0] == len(grids) else [t * h * w // (4 if "Qwen" in model else 1)
                                                               for t, h, w in grids]
    return min(float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))
               for a, b in zip(out.split(rows), ref.split(rows)))


def _cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")


def _print(row: dict) -> None:
    impls = row["impls"]
    wall = {k: v["median_s"] for k, v in impls.items()}
    cpu = {k: v["cpu_median_s"] for k, v in impls.items()}
    layers = f" layers={row['layers']}" if row.get("layers") else ""
    print(f"\n{row['workload']} {row['dtype']} threads={row['threads']}{layers} load {' -> '.join(row['loadavg'])}"
          + (f" bf16-vs-fp32 min cosine {row['cosine_vs_fp32_min']:.5f}" if "cosine_vs_fp32_min" in row else ""))
    for k, v in impls.items():
        ratios = "  ".join(f"{wall[o] / v['median_s']:.2f}x/{cpu[o] / v['cpu_median_s']:.2f}x vs {o.split(' ')[0]}"
                           for o in wall if o != k)
        err = f"  rel err vs transformers {v['rel_err_vs_transformers']:.1e}" if "rel_err_vs_transformers" in v else ""
        print(f"  {k:22s} wall {v['median_s']:7.2f} s ({v['min_s']:.2f}-{v['max_s']:.2f})  "
              f"cpu {v['cpu_median_s']:7.2f} s "
              f"({v['cpu_min_s']:.2f}-{v['cpu_max_s']:.2f})  wall/cpu speed-up {ratios}{err}")
        if "ops" in v:
            top = list(v["ops"].items())[:8]
            print("      cpu s by op: " + ", ".join(f"{n} {e['cpu_s']:.2f}" for n, e in top))
    mem = {k: v for k, v in row.items() if k.endswith("bytes")}
    print("  memory: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in mem.items()), flush=True)


if __name__ == "__main__":
    main()
