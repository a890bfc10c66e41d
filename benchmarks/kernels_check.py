"""Issue 27's kernel checks on one GPU: FP8 vs bf16 GEMMs, the fused row kernels vs the ops they replace,
and FP8 accuracy on the full Qwen2.5-VL-7B tower. Part of benchmarks/kernels_gpu.sh; prints short tables.

    python benchmarks/kernels_check.py gemm        # bf16 vs FP8 (_scaled_mm, row-wise scales) on the tower's shapes
    python benchmarks/kernels_check.py rows        # add+RMSNorm, SiLU-gate (and their FP8 forms) vs torch / Inductor
    python benchmarks/kernels_check.py accuracy    # fp8 / fp8-all vs bf16 and fp32 (the bar of issue 27)
    python benchmarks/kernels_check.py kpad        # bf16 MLP GEMMs with the 3420-wide dimension zero-padded
"""
import argparse
import json

import torch
import torch.nn.functional as F

from mmenc.backends.kernels import fused_rows
from mmenc.backends.linear.fp8 import Fp8Linear, padded, quantize_rows
from mmenc.bench.measure import time_ms
from mmenc.testing.quant_accuracy import fp8_accuracy

QWEN = "Qwen/Qwen2.5-VL-7B-Instruct"
# (name, rows, in, out) of one Qwen2.5-VL-7B block at 8 x 1036 px (43,808 tokens)
SHAPES = [("qkv", 43808, 1280, 3840), ("proj", 43808, 1280, 1280), ("gate_up", 43808, 1280, 6840),
          ("down", 43808, 3420, 1280)]


def gemm() -> None:
    dev = torch.device("cuda")
    print(f"{'linear':<8} {'M x K x N':<20} {'bf16 ms':>8} {'fp8 ms':>8} {'fp8 fast':>9} {'x bf16':>7} {'x fast':>7}")
    for name, m, k, n in SHAPES:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = 0.02 * torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        state = Fp8Linear.prepare(w, None)
        q = quantize_rows(x, padded(k))
        wq, ws = state.extras["padded"], state.extras["scale"]
        bf16 = time_ms(lambda: F.linear(x, w), dev, 5, 20)
        fp8 = time_ms(lambda: torch._scaled_mm(q.data, wq.t(), scale_a=q.scale, scale_b=ws,
                                               out_dtype=torch.bfloat16), dev, 5, 20)
        fast = time_ms(lambda: torch._scaled_mm(q.data, wq.t(), scale_a=q.scale, scale_b=ws,
                                                out_dtype=torch.bfloat16, use_fast_accum=True), dev, 5, 20)
        print(f"{name:<8} {f'{m}x{k}x{n}':<20} {bf16:>8.3f} {fp8:>8.3f} {fast:>9.3f} {bf16 / fp8:>6.2f}x "
              f"{bf16 / fast:>6.2f}x")


def kpad() -> None:
    """The MLP's bf16 GEMMs at 8 x 1036 px / 32 x 448 px with its intermediate size (3420) padded with zeros to
    wider multiples: does cuBLAS serve an aligned width faster than the extra columns cost?"""
    dev = torch.device("cuda")
    print(f"{'linear':<8} {'M x K x N':<20} {'ms':>8} {'TFLOP/s':>8}")
    for m in (43808, 32768):
        for name, widths in (("down", (3420, 3424, 3456, 3584)), ("gate_up", (6840, 6848, 6912, 7168))):
            for width in widths:
                k, n = (width, 1280) if name == "down" else (1280, width)
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                w = 0.02 * torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                ms = time_ms(lambda: F.linear(x, w), dev, 5, 20)
                print(f"{name:<8} {f'{m}x{k}x{n}':<20} {ms:>8.3f} {2 * m * k * n / ms / 1e9:>8.1f}")


def rows() -> None:
    dev = torch.device("cuda")
    t, d, f = 43808, 1280, 3420
    x, delta = (torch.randn(t, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(d, device=dev, dtype=torch.bfloat16) + 0.5
    h = torch.randn(t, 2 * f, device=dev, dtype=torch.bfloat16)

    def ref_add_norm(x, delta, w):
        s = x + delta
        return F.rms_norm(s, (d,), w, 1e-6), s

    def ref_gate(h):
        gate, up = h.chunk(2, -1)
        return F.silu(gate) * up

    compiled_add_norm, compiled_gate = torch.compile(ref_add_norm), torch.compile(ref_gate)
    cases = [
        ("add + RMSNorm", 3 * t * d * 2, lambda: ref_add_norm(x, delta, w), lambda: compiled_add_norm(x, delta, w),
         lambda: fused_rows.add_norm(x, delta, w, None, 1e-6, "rms")),
        ("SiLU-gate", 3 * t * f * 2, lambda: ref_gate(h), lambda: compiled_gate(h),
         lambda: fused_rows.act(h, "silu", True)),
        ("add + RMSNorm -> FP8", t * d * 7, lambda: quantize_rows(ref_add_norm(x, delta, w)[0]),
         torch.compile(lambda: quantize_rows(ref_add_norm(x, delta, w)[0])),
         lambda: fused_rows.add_norm_fp8(x, delta, w, None, 1e-6, "rms", d)),
        ("SiLU-gate -> FP8", t * f * 5, lambda: quantize_rows(ref_gate(h), padded(f)),
         torch.compile(lambda: quantize_rows(ref_gate(h), padded(f))),
         lambda: fused_rows.act_fp8(h, "silu", True, padded(f))),
    ]
    print(f"{'op (43808 rows)':<22} {'eager ms':>9} {'inductor':>9} {'fused':>7} {'fused GB/s':>10}")
    for name, nbytes, eager, inductor, fused in cases:
        e, i, k = (time_ms(fn, dev, 3, 20) for fn in (eager, inductor, fused))
        print(f"{name:<22} {e:>9.3f} {i:>9.3f} {k:>7.3f} {nbytes / (k / 1e3) / 1e9:>10.0f}")


def accuracy() -> None:
    grids = [(1, 32, 32)] * 2 + [(1, 74, 74)]
    modes = ("bf16+fused", "fp8", "fp8+fused", "fp8-all", "fp8-all+fused")
    report = fp8_accuracy(QWEN, grids, device="cuda", modes=modes)
    print("report: " + json.dumps(report))
    print(f"{'mode':<14} {'cosine min vs bf16':>18} {'err vs fp32':>12} {'x bf16 err':>10} {'bar':>5}")
    print(f"{'bf16':<14} {'-':>18} {report['bf16']['err_vs_fp32']:>12.4f} {'1.00':>10} {'-':>5}")
    for mode in modes:
        r = report[mode]
        print(f"{mode:<14} {r['cosine_min']:>18.5f} {r['err_vs_fp32']:>12.4f} {r['err_ratio']:>10.2f} "
              f"{'met' if r['meets_bar'] else 'no':>5}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=["gemm", "rows", "accuracy", "kpad"])
    {"gemm": gemm, "rows": rows, "accuracy": accuracy, "kpad": kpad}[parser.parse_args().check]()
