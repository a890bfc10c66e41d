"""SigLIP / SigLIP2 end to end: image files -> embeddings on the device, mmenc vs transformers.

mmenc: `Encoder.encode(paths)` (load, HF-exact preprocessing, packed tower) and `encode(paths,
pooled=True)` (plus the attention-pooling head: the image-embedding use). transformers: PIL open ->
its image processor (the default torchvision class where torchvision imports, else the PIL class) ->
its vision model (sdpa) on the padded batch, `last_hidden_state` / `pooler_output`. Same weights
(the built-in's random weights, shared through mmenc.bench.hf_reference), same files: JPEGs of mixed
aspect ratios written to a temporary folder. Tower-only numbers: `mmenc bench` (docs/towers.md).

    python benchmarks/siglip_e2e.py [--model google/siglip2-so400m-patch16-naflex] [--images 32]
        [--compile] [--json out.json]        # --smoke: a tiny checkpoint on CPU
"""
import argparse
import importlib.util
import json
import os
import pathlib
import sys
import tempfile

import numpy as np
import torch
from PIL import Image

from mmenc.bench.hf_reference import build_hf_tower
from mmenc.bench.measure import format_table, measure
from mmenc.engine.encoder import Encoder

# (height, width) of the test photos: 4:3, 3:4, 16:9, 9:16, 1:1, 1:2, 2:1, 3:1
SIZES = [(768, 1024), (1024, 768), (1080, 1920), (1920, 1080), (800, 800), (700, 1400), (1400, 700), (600, 1800)]


def write_images(folder: pathlib.Path, count: int, scale: float) -> list[str]:
    rng = np.random.default_rng(0)
    paths = []
    for i in range(count):
        h, w = (max(16, int(s * scale)) for s in SIZES[i % len(SIZES)])
        small = rng.integers(0, 256, (h // 8 + 1, w // 8 + 1, 3), dtype=np.uint8)  # smooth-ish content
        image = Image.fromarray(small).resize((w, h), Image.Resampling.BILINEAR)
        paths.append(str(folder / f"im{i:03d}.jpg"))
        image.save(paths[-1], quality=90)
    return paths


def hf_processor(enc: Encoder):
    """transformers' processor with mmenc's processor settings (same sizes, so the same grids)."""
    from transformers.models import siglip, siglip2

    c = enc.processor.config
    tv = importlib.util.find_spec("torchvision") is not None
    common = dict(image_mean=list(c.image_mean), image_std=list(c.image_std))
    if c.naflex:
        cls = siglip2.Siglip2ImageProcessor if tv else siglip2.Siglip2ImageProcessorPil
        return cls(patch_size=c.patch_size, max_num_patches=c.max_num_patches, **common)
    cls = siglip.SiglipImageProcessor if tv else siglip.SiglipImageProcessorPil
    return cls(size={"height": c.height, "width": c.width}, resample=3 if c.resample == "bicubic" else 2, **common)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", action="append", default=None,
                        help="built-in SigLIP/SigLIP2 name (repeatable; default: both so400m towers)")
    parser.add_argument("--images", type=int, default=32)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints on CPU, 4 small images")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    rows, report = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        paths = write_images(tmp, 4 if args.smoke else args.images, 0.1 if args.smoke else 1.0)
        if args.smoke:
            from mmenc.testing import checkpoints as ck

            models = [str(ck.save_siglip(tmp / "v1")[0]), str(ck.save_siglip(tmp / "v2", version=2)[0])]
        else:
            models = args.model or ["google/siglip-so400m-patch14-384", "google/siglip2-so400m-patch16-naflex"]
        for model in models:
            enc = Encoder(model, dtype=dtype, device=device, compile=args.compile,
                          load_format="auto" if os.path.isdir(model) else "dummy")
            hf = build_hf_tower(enc.loaded)  # shares its weights with enc's tower
            proc, naflex = hf_processor(enc), enc.processor.config.naflex
            grids = [tuple(g) for g in enc.preprocess(paths)[1].tolist()]
            name = pathlib.Path(model).name

            def hf_run(pooled: bool):
                hf.module.use_head = pooled
                with torch.inference_mode():
                    batch = proc(images=[Image.open(p) for p in paths], return_tensors="pt").to(device)
                    pixel_values = batch["pixel_values"].to(dtype)
                    if naflex:
                        out = hf.module(pixel_values=pixel_values, pixel_attention_mask=batch["pixel_attention_mask"],
                                        spatial_shapes=batch["spatial_shapes"])
                    else:
                        out = hf.module(pixel_values=pixel_values)
                    return out.pooler_output if pooled else out.last_hidden_state

            ours_pooled = torch.stack(enc.encode(paths, pooled=True)).float()
            theirs_pooled = hf_run(True).float()
            err = ((ours_pooled - theirs_pooled).norm() / theirs_pooled.norm()).item()
            label = f"mmenc{' compiled' if args.compile else ''} ({enc.attention_backends()})"
            for pooled in (False, True):
                what = f"{name}{' pooled' if pooled else ''}"
                rows.append(measure(what, label, lambda: enc.encode(paths, pooled=pooled), grids, device, 2,
                                    args.iters, 0.0))
                rows.append(measure(what, "transformers (sdpa)", lambda: hf_run(pooled), grids, device, 2,
                                    args.iters, 0.0))
            report[model] = {"grids": grids, "pooled_relative_error_vs_transformers": err,
                             "hf_processor": type(proc).__name__}
            print(f"{model}: pooled embeddings vs transformers' pipeline: relative error {err:.2e} "
                  f"({type(proc).__name__})", file=sys.stderr)
            enc.close()
    print(format_table(rows, None))
    if args.json:
        report["rows"] = [dict(workload=r.workload, impl=r.impl, images=r.images, ms=r.ms, images_per_s=r.images_per_s,
                               peak_gib=r.peak_gib) for r in rows]
        report["gpu"] = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        pathlib.Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
