"""Peak memory of a tower forward's intermediates, measured on the CPU, projected to a GPU workload.

Builds a built-in tower at its published widths (depth cut to --depth blocks: every block has the same
peak) with random weights and records every allocation of one forward (torch.profiler, CPU allocator)
at two small workloads (--small, --large). Each allocation's size is fitted as linear in the patch
count and extrapolated to the full workload (--grid), then replayed through a model of the CUDA caching
allocator (mmenc.bench.alloc_sim): `live` is the largest sum of live intermediates (what
max_memory_allocated would add to the weights and inputs), `pool` what a CUDA-graph pool captured from
that forward would hold (live plus the allocator's fragmentation; what `mmenc bench` adds for a graphed
call as graph_pool_gib, plus the output it keeps). Inputs, weights and plan tables made before the
forward are not counted.

  python benchmarks/peak_memory_cpu.py --model thisisiron/Ovis2-8B-hf --grid '7x32x32*8' \
      --small '1x32x32*2' --large '1x32x32*3'
  python benchmarks/peak_memory_cpu.py --model OpenGVLab/InternVL3-78B-hf --grid '7x32x32*8' \
      --small '1x32x32*2' --large '1x32x32*3' --compile

--compile runs the blocks through torch.compile (inductor's CPU code: its buffer frees and reuse come
from the same scheduler as on a GPU; its fusions can differ). A model, not a GPU measurement: the
GPU's attention kernels and inductor's CUDA fusions may allocate differently. Eager rms_norm allocates
only its output, as the GPU's fused kernel (mmenc.bench.alloc_sim.gpu_like_norms; --cpu-norms: torch's
CPU composite with its float32 temporaries, the modelling before). Compiled, cats lower as on a GPU
(inductor's pointwise cat, fused into its consumer: the rotary's rotate-half is no float32 buffer; its CPU
lowering always realizes a cat); --cpu-norms keeps the CPU lowering too.
"""
import argparse
import contextlib
import json
import sys

import torch

from mmenc.bench.alloc_sim import CachingAllocatorModel, extrapolate, gpu_like_norms, trace
from mmenc.bench.measure import parse_grid_spec
from mmenc.config import MultiModalConfig, use_multimodal_config
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, set_max_intermediate_bytes
from mmenc.models.registry import get_builtin_config


def build(model: str, depth: int | None, dtype: torch.dtype, mm: MultiModalConfig):
    """A built-in tower (depth blocks, random weights) and its config."""
    spec, hf_config = get_builtin_config(model)
    config = spec.config_from_hf(hf_config)
    if depth is not None:
        config = type(config)(**{**vars(config), "depth": depth})
    torch.manual_seed(0)
    with use_multimodal_config(mm):
        tower = spec.tower_cls(config, device="cpu", dtype=dtype).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    return tower, config


def forward_trace(tower, config, spec: str, dtype: torch.dtype, budget: int | None, n_full: int) -> tuple[list, int]:
    """(allocation trace of one forward on `spec`'s grids, its patch count), after a first forward. The
    row-block budget is scaled by patches / n_full, so the small run splits as the full one would."""
    grid_thw = torch.tensor(parse_grid_spec(spec), dtype=torch.int64)
    patches = int(grid_thw.prod(-1).sum())
    set_max_intermediate_bytes(tower, None if budget is None else -(-budget * patches // n_full))
    pixels = torch.randn(patches, config.patch_features, dtype=dtype)
    with torch.inference_mode():
        tower(pixels, grid_thw)  # plan tables, compilation, lazy state
        seq, _ = trace(lambda: tower(pixels, grid_thw))
    return seq, patches


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a built-in model name (mmenc.models.registry)")
    p.add_argument("--grid", required=True, metavar="TxHxW[*N]", help="the full workload")
    p.add_argument("--small", required=True, metavar="TxHxW[*N]", help="a small workload of the same layout")
    p.add_argument("--large", required=True, metavar="TxHxW[*N]", help="a larger one (different patch count)")
    p.add_argument("--depth", type=int, default=2, help="blocks to build (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--compile", action="store_true", help="blocks through torch.compile (inductor)")
    p.add_argument("--max-intermediate-bytes", type=int, default=MAX_INTERMEDIATE_BYTES,
                   help="row-block budget at the full workload (mmenc.layers.row_blocks; 0: never split; "
                        "default: %(default)s)")
    p.add_argument("--cpu-norms", action="store_true",
                   help="keep torch's CPU rms_norm (float32 temporaries the GPU's fused kernel does not make); "
                        "default: eager rms_norm allocates only its output, as on a GPU (alloc_sim.gpu_like_norms)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    mm = MultiModalConfig(compile=args.compile)
    tower, config = build(args.model, args.depth, dtype, mm)
    if args.compile:
        from mmenc.engine.compile import compile_tower
        if not args.cpu_norms:  # as on a GPU: inductor's CPU lowering realizes every cat (ConcatKernel)
            torch._inductor.config.force_pointwise_cat = True
        compile_tower(tower, mm)
    n_full = sum(t * h * w for t, h, w in parse_grid_spec(args.grid))
    budget = args.max_intermediate_bytes or None
    with contextlib.nullcontext() if args.cpu_norms else gpu_like_norms():
        small, n_small = forward_trace(tower, config, args.small, dtype, budget, n_full)
        large, n_large = forward_trace(tower, config, args.large, dtype, budget, n_full)
    model = CachingAllocatorModel().replay(extrapolate(small, large, n_small, n_large, n_full))
    unit = n_full * config.hidden_size * dtype.itemsize  # one residual [patches, hidden] tensor
    row = {"model": args.model, "grid": args.grid, "patches": n_full, "depth": args.depth, "compile": args.compile,
           "gpu_like_norms": not args.cpu_norms,
           "max_intermediate_bytes": budget,
           "dtype": args.dtype, "live_gib": model.peak_live / 2**30, "pool_gib": model.reserved / 2**30,
           "residual_gib": unit / 2**30, "segments_mib": [round(sum(b.size for b in s) / 2**20) for s in model.segments]}
    print(f"{args.model} {'compiled' if args.compile else 'eager'} {args.grid} ({n_full} patches, row-block budget "
          f"{budget}): live "
          f"{row['live_gib']:.2f} GiB, graph pool {row['pool_gib']:.2f} GiB (one [patches, hidden] tensor: "
          f"{row['residual_gib']:.3f} GiB); segments MiB {row['segments_mib']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
