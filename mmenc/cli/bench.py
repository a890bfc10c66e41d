"""`mmenc bench`: tower throughput on DESIGN.md's workloads, side by side with transformers."""
import argparse
import json
import sys
import time

import torch

from mmenc.cli.common import add_encoder_args, encoder_kwargs
from mmenc.bench.measure import WORKLOADS, format_table, matmul_tflops, measure, parse_grid_spec, random_pixels
from mmenc.engine.encoder import DEFAULT_MODEL


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time the tower on standard workloads (and transformers' tower beside it)",
                       description="Time mmenc's tower (and, when transformers is installed, transformers' own "
                                   "tower with the same weights, in the same run) on random inputs.")
    add_encoder_args(p, f"default: {DEFAULT_MODEL}, random weights")
    p.add_argument("--workload", action="append", choices=sorted(WORKLOADS), default=None,
                   help="a DESIGN.md workload (repeatable; default: all)")
    p.add_argument("--grid", action="append", default=None, metavar="TxHxW[*N]",
                   help="a custom workload of N images of grid TxHxW patches (repeatable)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-hf", action="store_true", help="skip transformers' tower")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation (default: %(default)s)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    return p


def run(args) -> int:
    from mmenc.engine.encoder import Encoder
    from mmenc.bench.flops import count_flops
    from mmenc.bench.hf_reference import build_hf_tower, hf_tower_available

    workloads = {name: WORKLOADS[name] for name in (args.workload or ([] if args.grid else sorted(WORKLOADS)))}
    for spec in args.grid or []:
        workloads[spec] = parse_grid_spec(spec)
    encoder = Encoder(**encoder_kwargs(args, DEFAULT_MODEL))
    loaded = encoder.loaded
    device, dtype = encoder.device, loaded.dtype
    hf = None
    if not args.no_hf and args.tensor_parallel_size == 1:
        arch = loaded.hf_config.get("architectures", ["?"])[0]
        why = hf_tower_available(arch)
        if why is None:
            hf = build_hf_tower(loaded, args.hf_attn)  # dummy weights: mmenc takes transformers' weights
        else:
            print(f"mmenc bench: transformers side skipped: {why}", file=sys.stderr)
    ceiling = matmul_tflops(device, dtype) if device.type == "cuda" else None
    channels = loaded.config.in_channels * loaded.config.temporal_patch_size * loaded.config.patch_size ** 2
    rows, results = [], []
    for name, grids in workloads.items():
        pixel_values, grid_thw = random_pixels(grids, channels, device, dtype)
        gflop = 0.0
        tower = getattr(loaded, "tower", None)
        if tower is not None:
            with count_flops(tower) as counter, torch.compiler.set_stance("force_eager"):
                encoder.encode_pixels(pixel_values, grid_thw)  # hooks count; compiled blocks run eagerly
            gflop = counter["flops"] / 1e9
        start = time.perf_counter()
        ours = encoder.encode_pixels(pixel_values, grid_thw)  # first call: pays torch.compile if enabled
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        first_s = time.perf_counter() - start
        print(f"{name}: first call {first_s:.1f} s", file=sys.stderr)
        mm = encoder.mm_config
        label = (f"mmenc{' compiled' if mm.compile else ''}{' +graphs' if mm.cuda_graphs else ''} "
                 f"({encoder.attention_backends()})")
        rows.append(measure(name, label,
                            lambda: encoder.encode_pixels(pixel_values, grid_thw), grids, device,
                            args.warmup, args.iters, gflop))
        entry = {"workload": name, "grids": grids, "gflop": gflop, "first_call_s": first_s}
        if hf is not None:
            ref = hf(pixel_values, grid_thw)
            err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
            entry["rel_err_vs_transformers"] = err
            rows.append(measure(name, f"transformers ({args.hf_attn})", lambda: hf(pixel_values, grid_thw), grids,
                                device, args.warmup, args.iters, gflop))
            print(f"{name}: mmenc vs transformers relative error {err:.2e}", file=sys.stderr)
        results.append(entry)
    print(f"model={encoder.model_name} dtype={str(dtype).removeprefix('torch.')} device={device} "
          f"torch={torch.__version__}" + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
          + (f" matmul_ceiling={ceiling:.0f} TFLOP/s" if ceiling else ""))
    print(format_table(rows, ceiling))
    if args.json:
        payload = {"model": encoder.model_name, "dtype": str(dtype), "device": str(device), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "matmul_tflops": ceiling, "workloads": results,
                   "rows": [dict(vars(r), images_per_s=r.images_per_s, patches_per_s=r.patches_per_s) for r in rows]}
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=1)
    encoder.close()
    return 0
