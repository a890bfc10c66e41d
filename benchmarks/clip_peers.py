"""CLIP ViT-L/14-336 tower against its peers in one run (issue 31, item 5): mmenc (eager; compiled + CUDA
graphs) beside transformers' CLIPVisionModel (sdpa, eager and torch.compile), timm's
vit_large_patch14_clip_336 (torch.compile) and open_clip's ViT-L-14-336 visual tower (eager), bf16, random
weights, dense batches of 336 px images.

mmenc and transformers share their weights (mmenc.bench.hf_reference), so their outputs are compared
(relative error printed); timm and open_clip have their own random weights: timing only. Each row is the
median of CUDA-event timings after warm-up (mmenc.bench.measure); "floor %" is the linear-layer +
attention FLOPs of mmenc's tower (mmenc.bench.flops) over the bf16 matmul rate measured in the same run.
A peer whose package is not importable is skipped with the reason (timm, open_clip_torch).

    python benchmarks/clip_peers.py --batches 32,256 --json OUT/clip_peers.json
    python benchmarks/clip_peers.py --smoke            # CPU, a tiny CLIP checkpoint, mmenc + transformers only
"""
import argparse
import copy
import json
import pathlib
import os
import sys
import tempfile

import torch

from mmenc.bench.flops import count_flops
from mmenc.bench.hf_reference import build_hf_tower
from mmenc.bench.measure import format_table, matmul_tflops, measure
from mmenc.config import MultiModalConfig
from mmenc.engine.tower import build_tower, run_tower

MODEL = "openai/clip-vit-large-patch14-336"


def images_of(pixel_values: torch.Tensor, batch: int, side: int, patch: int) -> torch.Tensor:
    """mmenc's patch rows [B*s*s, C*p*p] -> the same pixels as images [B, C, s*p, s*p] (for the peers)."""
    return pixel_values.view(batch, side, side, 3, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(
        batch, 3, side * patch, side * patch)


def peer_timm(device, dtype):
    """timm's vit_large_patch14_clip_336 (random weights), forward_features compiled; or the reason it cannot run."""
    try:
        import timm
    except ImportError as e:
        return None, f"timm is not importable ({e}); pip install timm"
    model = timm.create_model("vit_large_patch14_clip_336", pretrained=False).to(device, dtype).eval()
    return torch.compile(model.forward_features), None


def peer_open_clip(device, dtype):
    """open_clip's ViT-L-14-336 visual tower (random weights), eager; or the reason it cannot run."""
    try:
        import open_clip
    except ImportError as e:
        return None, f"open_clip is not importable ({e}); pip install open_clip_torch (needs torchvision)"
    model = open_clip.create_model("ViT-L-14-336", pretrained=None)
    return model.visual.to(device, dtype).eval(), None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=MODEL, help="a CLIP built-in name or checkpoint folder (default: %(default)s)")
    parser.add_argument("--batches", default="32,256", help="images per call, comma-separated (default: %(default)s)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, a tiny checkpoint, float32, no peers")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    tmp = tempfile.TemporaryDirectory()
    model = args.model
    if args.smoke:
        from mmenc.testing import checkpoints as ck

        model = str(ck.save_clip(pathlib.Path(tmp.name) / "clip")[0])
    load = "auto" if os.path.isdir(model) else "dummy"  # a built-in name: random weights (shared with transformers)
    eager = build_tower(model, load_format=load, dtype=dtype, device=device)
    fast = eager if args.smoke else build_tower(model, load_format=load, dtype=dtype, device=device,
                                                multimodal_config=MultiModalConfig(compile=True, cuda_graphs=True))
    hf = build_hf_tower(eager)  # dummy weights: the mmenc tower takes transformers' weights
    hf_compiled = None
    if fast is not eager:
        fast.tower.load_state_dict(eager.tower.state_dict())
        hf_compiled = copy.copy(hf)  # the same module (weights), called through torch.compile
        hf_compiled.module = torch.compile(hf.module)
    peers = {} if args.smoke else {"timm compiled": peer_timm(device, dtype), "open_clip eager": peer_open_clip(device, dtype)}
    config = eager.config
    side, patch = config.image_size // config.patch_size, config.patch_size
    floor = matmul_tflops(device, dtype)
    rows, report = [], {"model": args.model, "matmul_tflops": floor, "skipped": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        grid = torch.tensor([[1, side, side]] * batch)
        grids = [tuple(g) for g in grid.tolist()]
        pixels = torch.randn(batch * side * side, 3 * patch * patch, device=device, dtype=dtype)
        images = images_of(pixels, batch, side, patch)
        with count_flops(eager.tower) as counter, torch.inference_mode():
            want = run_tower(eager, pixels, grid).embeddings
        gflop, name = counter["flops"] / 1e9, f"{batch}x{side * patch}px"
        got = hf(pixels, grid)
        err = ((want.float() - got.float()).norm() / got.float().norm()).item()
        report[f"rel_err_vs_transformers_{batch}"] = err
        print(f"{name}: mmenc vs transformers relative error {err:.2e}", file=sys.stderr)
        calls = {"mmenc (eager)": lambda: run_tower(eager, pixels, grid),
                 "transformers (sdpa)": lambda: hf(pixels, grid)}
        if fast is not eager:
            calls["mmenc compiled +graphs"] = lambda: run_tower(fast, pixels, grid)
            calls["transformers compiled"] = lambda: hf_compiled(pixels, grid)
        for label, (fn, why) in peers.items():
            if fn is None:
                report["skipped"][label] = why
                print(f"{label}: skipped: {why}", file=sys.stderr)
                continue
            calls[label] = (lambda f: lambda: f(images))(fn)
        for label, fn in calls.items():
            with torch.inference_mode():
                rows.append(measure(name, label, fn, grids, device, args.warmup, args.iters, gflop))
    print(format_table(rows, floor))
    if args.json:
        report["rows"] = [dict(workload=r.workload, impl=r.impl, images=r.images, ms=r.ms, images_per_s=r.images_per_s,
                               peak_gib=r.peak_gib, graph_pool_gib=r.graph_pool_gib, gflop=r.gflop) for r in rows]
        report["gpu"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        report["torch"] = torch.__version__
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
