"""Full-size towers in bf16 on the GPU against transformers' float32 result on the same weights.

Weights are random but well scaled (transformers' own init for Qwen2.5-VL; normal(0, 0.02) for
Kimi), so 27-32 layers stay numerically tame. For each case prints
  mmenc bf16 vs transformers fp32, and transformers bf16 vs transformers fp32 (bf16's own error).
    python benchmarks/parity_fp32.py [--compile]
"""
import argparse
import sys
import tempfile

import torch

from mmenc.bench.measure import WORKLOADS
from mmenc.engine.encoder import Encoder
from mmenc.bench.hf_reference import build_hf_tower


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def qwen2_5(compile_: bool) -> dict[str, tuple[float, float]]:
    enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy", dtype="bfloat16", compile=compile_)
    hf = build_hf_tower(enc.loaded)  # bf16, transformers' random init, shared with mmenc
    inputs = {}
    for name, grids in WORKLOADS.items():
        grid = torch.tensor(grids)
        pixels = torch.randn(int(grid.prod(-1).sum()), 1176, device="cuda", dtype=torch.bfloat16)
        inputs[name] = (pixels, grid, enc.encode_pixels(pixels, grid), hf(pixels, grid))
    hf.module.float()
    errors = {}
    for name, (pixels, grid, ours, hf_bf16) in inputs.items():
        fp32 = hf(pixels.float(), grid)
        errors[name] = (rel(ours, fp32), rel(hf_bf16, fp32))
    return errors


def kimi(compile_: bool) -> dict[str, tuple[float, float]]:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    from mmenc.testing import checkpoints as ck  # tiny checkpoint writers (was tests/checkpoints.py)

    vision = {**ck.TINY_KIMI_VISION, **dict(hidden_size=1152, num_attention_heads=16, num_hidden_layers=27,
                                            intermediate_size=4304, pos_emb_height=64, pos_emb_width=64)}
    config = Kimi_K25Config(vision_config=vision, text_config=dict(ck.TINY_DEEPSEEK_TEXT),
                            projection_hidden_size=1152, dtype=torch.float32)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                if p.dim() >= 2:
                    p.normal_(0, 0.02)
                else:
                    p.fill_(1.0 if "norm" in name and name.endswith("weight") else 0.0)
    inputs = {name: torch.tensor(grids) for name, grids in WORKLOADS.items()}
    pixels = {name: torch.randn(int(g.prod(-1).sum()), 3, 14, 14, device="cuda") for name, g in inputs.items()}
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        enc = Encoder(folder, dtype="bfloat16", compile=compile_)
        ours = {name: enc.encode_pixels(pixels[name].bfloat16(), g) for name, g in inputs.items()}
    model = model.cuda()

    def features(name, dtype):
        with torch.inference_mode():
            out = model.model.get_image_features(pixels[name].to(dtype), inputs[name].cuda()).pooler_output
        return torch.cat(list(out))
    fp32 = {name: features(name, torch.float32) for name in inputs}
    model = model.bfloat16()
    return {name: (rel(ours[name], fp32[name]), rel(features(name, torch.bfloat16), fp32[name])) for name in inputs}

def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    for name, fn in (("Qwen2.5-VL-7B tower", qwen2_5), ("Kimi-K2.5 MoonViT", kimi)):
        for workload, (ours, hf) in fn(args.compile).items():
            print(f"{name:<22} {workload:<9} mmenc bf16{' compiled' if args.compile else ''} vs transformers fp32: "
                  f"{ours:.2e}   transformers bf16 vs fp32: {hf:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
