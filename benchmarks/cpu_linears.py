"""The CPU linear kernels, one linear at a time: F.linear against oneDNN on the plain weight and on the
weight packed once (mmenc's ONEDNN), and the GELU post-op fused or after the matmul, on the shapes of the
Qwen2.5-VL-7B and SigLIP so400m towers. Single-thread CPU time (getrusage): on a shared machine it moves
far less than wall time; medians and ranges of alternating calls.

    python benchmarks/cpu_linears.py [--rows-scale 0.25] [--rounds 7] [--threads 1]
"""
import argparse
import resource
import statistics

import torch
import torch.nn.functional as F

SHAPES = [  # name, rows, in, out (rows: a 4 x 448 px Qwen call, an 8-image SigLIP batch)
    ("qwen qkv", 4096, 1280, 3840), ("qwen proj", 4096, 1280, 1280), ("qwen gate_up", 4096, 1280, 6840),
    ("qwen down", 4096, 3420, 1280), ("qwen merger fc1", 1024, 5120, 5120), ("qwen merger fc2", 1024, 5120, 3584),
    ("siglip qkv", 5832, 1152, 3456), ("siglip fc1", 5832, 1152, 4304), ("siglip fc2", 5832, 4304, 1152),
]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def timed(fns: dict, rounds: int) -> dict:
    for fn in fns.values():
        fn()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            start = cpu_s()
            fn()
            times[k].append(cpu_s() - start)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows-scale", type=float, default=0.25)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    mk = torch.ops.mkldnn
    for dtype in (torch.float32, torch.bfloat16):
        for name, rows, k, n in SHAPES:
            m = max(1, int(rows * args.rows_scale))
            x, w, b = torch.randn(m, k).to(dtype), (torch.randn(n, k) * 0.02).to(dtype), torch.randn(n).to(dtype)
            packed = mk._reorder_linear_weight(w, 4096)
            fns = {"F.linear": lambda: F.linear(x, w, b),
                   "onednn plain": lambda: mk._linear_pointwise(x, w, b, "none", [], ""),
                   "onednn packed": lambda: mk._linear_pointwise(x, packed, b, "none", [], "")}
            if "fc1" in name:
                alg = "tanh" if "siglip" in name else "none"
                fns["packed, then GELU"] = lambda: F.gelu(mk._linear_pointwise(x, packed, b, "none", [], ""),
                                                           approximate=alg)
                fns["packed + GELU post-op"] = lambda: mk._linear_pointwise(x, packed, b, "gelu", [], alg)
            times = timed(fns, args.rounds)
            base = statistics.median(times["F.linear"])
            cells = "  ".join(f"{key} {statistics.median(v) * 1e3:.1f} ms ({min(v) * 1e3:.1f}-{max(v) * 1e3:.1f}, "
                              f"{statistics.median(v) / base:.2f}x)" for key, v in times.items())
            print(f"{str(dtype).removeprefix('torch.'):8s} {name:16s} {m}x{k}x{n}: {cells}", flush=True)


if __name__ == "__main__":
    main()
