"""Kimi-K2.5's MoonViT tower (full published size, random weights, bf16): mmenc vs transformers.

transformers' Kimi_K25 model is built with the full vision config and a one-layer text model,
saved with save_pretrained (the published tensor names) and loaded by mmenc from that folder, so
both run the same weights; transformers' side is `get_image_features` (tower, temporal pooling,
projector), mmenc's is `Encoder.encode_pixels`. Same table as `mmenc bench`.

    python benchmarks/kimi_vs_transformers.py [--compile] [--json out.json]
"""
import argparse
import json
import pathlib
import sys
import tempfile

import torch

from mmenc.testing import checkpoints as ck
from mmenc.testing.random_weights import init_comparable_weights_  # tiny checkpoint writers (mmenc/testing, was tests/checkpoints.py)

from mmenc.bench.measure import WORKLOADS, format_table, matmul_tflops, measure
from mmenc.engine.encoder import Encoder

K25_VISION = dict(hidden_size=1152, num_attention_heads=16, num_hidden_layers=27, intermediate_size=4304,
                  patch_size=14, pos_emb_height=64, pos_emb_width=64, pos_emb_time=4)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="tiny tower, one small workload, on CPU")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    vision = ck.TINY_KIMI_VISION if args.smoke else K25_VISION
    workloads = {"2x112px": [(1, 8, 8)] * 2} if args.smoke else WORKLOADS
    dtype = torch.float32 if args.smoke else torch.bfloat16
    with tempfile.TemporaryDirectory() as folder:
        _, model = ck.save_kimi_k25(folder, vision=vision)
        # the savers' randn * 0.2 weights make a 27-layer tower chaotic (bf16 error ~0.7 against a correct
        # reference); a trained model's spread keeps the error column meaningful (mmenc.testing.random_weights)
        init_comparable_weights_(model, include=lambda name: "vision_tower" in name or "mm_projector" in name)
        model.save_pretrained(folder)
        model = model.to(device, dtype).eval()
        enc = Encoder(folder, dtype=dtype, device=device, compile=args.compile)
        ceiling = matmul_tflops(device, dtype)
        rows, errors = [], {}
        for name, grids in workloads.items():
            grid = torch.tensor(grids)
            patches = int(grid.prod(-1).sum())
            pixels = torch.randn(patches, 3, 14, 14, device=device, dtype=dtype)
            ours = enc.encode_pixels(pixels, grid)
            with torch.inference_mode():
                ref = torch.cat(list(model.model.get_image_features(pixels, grid.to(device)).pooler_output))
            errors[name] = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
            label = f"mmenc{' compiled' if args.compile else ''} ({enc.attention_backends()})"
            rows.append(measure(name, label, lambda: enc.encode_pixels(pixels, grid), grids, device, 3,
                                args.iters, 0.0))

            def hf():
                with torch.inference_mode():
                    return model.model.get_image_features(pixels, grid.to(device))
            rows.append(measure(name, "transformers (sdpa)", hf, grids, device, 3, args.iters, 0.0))
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"model=Kimi-K2.5 MoonViT (random weights) dtype={dtype} torch={torch.__version__} gpu={gpu} "
          f"matmul_ceiling={ceiling:.0f} TFLOP/s")
    print("relative error mmenc vs transformers (same dtype): " + ", ".join(f"{k} {v:.2e}" for k, v in errors.items()))
    print(format_table(rows, None))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"rows": [vars(r) for r in rows], "rel_err": errors}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
