"""Qwen2.5-VL-7B's full tower in bfloat16 against transformers' float32 on the same weights (CPU):
how far bf16 arithmetic alone moves the output, for mmenc and for transformers itself (~30 s).

    python benchmarks/bf16_vs_fp32_cpu.py
"""
import time, torch
from mmenc.engine.encoder import Encoder
from mmenc.bench.hf_reference import build_hf_tower
torch.set_num_threads(2)
def rel(a, b): return float((a.double() - b.double()).norm() / b.double().norm())
grid = torch.tensor([[1, 32, 32], [1, 16, 24]])
t = time.time()
enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", device="cpu", dtype="bfloat16", load_format="dummy")
hf = build_hf_tower(enc.loaded)              # bf16 HF tower; mmenc takes its weights
px = torch.randn(int(grid.prod(-1).sum()), 1176)
with torch.inference_mode():
    ours = enc.encode_pixels(px.bfloat16(), grid)
    hf_bf16 = hf(px.bfloat16(), grid)
    hf.module.float()
    ref = hf(px, grid)
print(f"Qwen2.5-VL-7B CPU: mmenc bf16 vs transformers fp32 {rel(ours, ref):.2e}; transformers bf16 vs fp32 "
      f"{rel(hf_bf16, ref):.2e}; mmenc bf16 vs transformers bf16 {rel(ours, hf_bf16):.2e} ({time.time()-t:.0f} s)", flush=True)
