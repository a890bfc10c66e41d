"""Full-size towers in float32 on CPU against transformers on the same weights (no GPU needed).

Qwen2.5-VL-7B's tower with transformers' own init, and Kimi-K2.5's MoonViT with weights normal(0, 0.02)
and normal(0, 0.2) (the second shows the chaos of over-scaled random weights: 27 layers amplify any
rounding difference, in fp32 as in bf16). About 2 minutes on 2 cores.

    python benchmarks/fullsize_parity_cpu.py
"""
import tempfile
import time

import torch

from mmenc.testing import checkpoints as ck  # tiny checkpoint writers (was tests/checkpoints.py)
from mmenc.engine.encoder import Encoder
from mmenc.bench.hf_reference import build_hf_tower
torch.set_num_threads(2)
def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
grid = torch.tensor([[1, 32, 32], [1, 16, 24]])
# Qwen2.5-VL-7B tower, full size, transformers' init, fp32 CPU
t = time.time()
enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", device="cpu", load_format="dummy")
hf = build_hf_tower(enc.loaded)
px = torch.randn(int(grid.prod(-1).sum()), 1176)
with torch.inference_mode():
    a = enc.encode_pixels(px, grid); b = hf(px, grid)
print(f"Qwen2.5-VL-7B tower fp32 CPU, grids {grid.tolist()}: rel err {rel(a, b):.2e} ({time.time()-t:.0f} s)", flush=True)
del enc, hf
# Kimi-K2.5 MoonViT, full size, two weight scales
from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration
for scale in (0.02, 0.2):
    t = time.time()
    vision = {**ck.TINY_KIMI_VISION, **dict(hidden_size=1152, num_attention_heads=16, num_hidden_layers=27,
                                            intermediate_size=4304, pos_emb_height=64, pos_emb_width=64)}
    cfg = Kimi_K25Config(vision_config=vision, text_config=dict(ck.TINY_DEEPSEEK_TEXT), projection_hidden_size=1152,
                         dtype=torch.float32)
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                if p.dim() >= 2: p.normal_(0, scale)
                else: p.normal_(1.0 if ("norm" in name and name.endswith("weight")) else 0.0, 0.1)
    px = torch.randn(int(grid.prod(-1).sum()), 3, 14, 14)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        enc = Encoder(d, device="cpu")
        with torch.inference_mode():
            a = enc.encode_pixels(px, grid)
            b = torch.cat(list(model.model.get_image_features(px, grid).pooler_output))
    print(f"Kimi-K2.5 MoonViT fp32 CPU, weights normal(0,{scale}), grids {grid.tolist()}: rel err {rel(a, b):.2e} "
          f"({time.time()-t:.0f} s)", flush=True)
    del enc, model
