"""Does a compiled tower's speed depend on the size of its first call, or on Inductor's forced padding? (GPU)

torch.compile compiles mmenc's blocks once with the token count dynamic, and Inductor decides some things
at that compile: whether to pad a matmul's misaligned K (Qwen2.5-VL's 3420-wide down projection) is
benchmarked there. This script builds a compiled Encoder in a fresh process with an empty Inductor cache,
makes a first call of `--first` (a grid), then times the workload; per case:

    default   mmenc's compile as shipped (Inductor decides the padding)
    forced    torch._inductor.config.force_shape_pad set (every misaligned matmul padded)

    python benchmarks/compile_first_call.py [--model Qwen/Qwen2.5-VL-7B-Instruct] [--first 1x16x16]
        [--workload 8x1036px] [--cases default:small,default:big,forced:small]

"small" makes the first call `--first`, "big" the workload itself. Median ms of --iters CUDA-event timed
calls after --warmup; random weights (load_format="dummy"), bf16, compiled, no CUDA graphs.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def one_case(args) -> None:
    import torch

    from mmenc import Encoder
    from mmenc.bench.measure import WORKLOADS, parse_grid_spec, random_pixels, time_ms

    if args.mode == "forced":
        import torch._inductor.config

        torch._inductor.config.force_shape_pad = True
    enc = Encoder(args.model, load_format="dummy", dtype="bfloat16", compile=True)
    channels = enc.loaded.config.patch_features
    grids = WORKLOADS.get(args.workload) or parse_grid_spec(args.workload)
    first = parse_grid_spec(args.first) if args.start == "small" else grids
    pv, grid = random_pixels(first, channels, enc.device, enc.dtype)
    enc.encode_pixels(pv, grid)
    pv, grid = random_pixels(grids, channels, enc.device, enc.dtype)
    ms = time_ms(lambda: enc.encode_pixels(pv, grid), enc.device, args.warmup, args.iters)
    print(json.dumps({"mode": args.mode, "first": args.start, "workload": args.workload, "ms": round(ms, 2),
                      "torch": torch.__version__}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    ap.add_argument("--first", default="1x16x16", help="the small first call's grid TxHxW (default: %(default)s)")
    ap.add_argument("--workload", default="8x1036px", help="a mmenc bench workload or TxHxW*N (default: %(default)s)")
    ap.add_argument("--cases", default="default:small,default:big,forced:small")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--start", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.mode:
        return one_case(args)
    for case in args.cases.split(","):
        mode, start = case.split(":")
        with tempfile.TemporaryDirectory(prefix="mmenc-inductor-") as cache:  # nothing decided before this case
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            subprocess.run([sys.executable, __file__, "--model", args.model, "--first", args.first, "--workload",
                            args.workload, "--warmup", str(args.warmup), "--iters", str(args.iters),
                            "--mode", mode, "--start", start], env=env, check=False)


if __name__ == "__main__":
    main()
