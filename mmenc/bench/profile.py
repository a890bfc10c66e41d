"""`mmenc bench --profile`: where a tower call's device time goes, per kernel class, against each class's floor.

    breakdown = kernel_breakdown(fn, device, iters=3)      # {"gemm": ms, "attention": ms, "elementwise": ms, ...}
    rows = format_breakdown([(label, breakdown, work)], matmul_tflops, copy_gbps)

Kernels are read from torch.profiler (CUDA activity; CUDA-graph replays included) and classified by name:
  gemm         cuBLAS / cuBLASLt (nvjet, sm90_xmma, cutlass, gemm), torch._scaled_mm's FP8 kernels, Inductor's
               matmul templates (triton_tem_)
  attention    flash / fmha / cuDNN attention, mmenc's Triton attention (_kernel, _windows_kernel), flex
  elementwise  everything else that computes: Inductor's fused kernels (triton_poi/red/per), torch's
               elementwise and reduction kernels, mmenc's fused row kernels (norm_kernel, act_kernel)
  memcpy       copies and sets
Floors: GEMM = the linears' FLOPs / the bf16 matmul rate measured in the same run; attention = the attention
FLOPs / that rate; elementwise = one write and one read of every linear's output (the traffic left when
nothing fuses into the GEMM epilogues) / the measured device copy bandwidth (read + write bytes per second).
An elementwise share above 100% of that floor is possible (norms and rotary read more); below it means epilogue
fusion.
"""
import collections
import re
from collections.abc import Callable

import torch

GEMM = re.compile(r"gemm|nvjet|xmma|cutlass|wgmma|triton_tem_|scaled_mm|cublas|f8f8|matmul", re.I)
ATTENTION = re.compile(r"flash|fmha|attn|attention|cudnn.*(sdpa|mha)|^_kernel$|^_windows_kernel$|flex|sdpa", re.I)
MEMCPY = re.compile(r"memcpy|memset|Memcpy|Memset", re.I)
CLASSES = ("gemm", "attention", "elementwise", "memcpy")


def classify(name: str) -> str:
    """The class ("gemm", "attention", "elementwise", "memcpy") of a CUDA kernel's name."""
    if MEMCPY.search(name):
        return "memcpy"
    if ATTENTION.search(name):
        return "attention"
    if GEMM.search(name):
        return "gemm"
    return "elementwise"


def kernel_breakdown(fn: Callable[[], object], device: torch.device, iters: int = 3) -> dict:
    """Device milliseconds per call of `fn` by kernel class, over `iters` profiled calls (after one
    unprofiled warm-up call), plus "total" and "top": the five longest kernels (name, ms per call, class)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize(device)
    by_class: dict[str, float] = collections.defaultdict(float)
    by_name: dict[str, float] = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        ms = event.device_time / 1e3 / iters  # us -> ms per call
        by_class[classify(event.name)] += ms
        by_name[event.name] += ms
    out = {c: by_class.get(c, 0.0) for c in CLASSES}
    out["total"] = sum(out.values())
    out["top"] = [(n[:60], ms, classify(n)) for n, ms in sorted(by_name.items(), key=lambda kv: -kv[1])[:5]]
    return out


def copy_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Measured device-to-device copy rate, bytes read + written per second / 1e9."""
    from mmenc.bench.measure import time_ms

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, warmup=3, iters=10)
    return 2 * src.nbytes / (ms / 1e3) / 1e9


def format_breakdown(rows: list[tuple[str, str, dict, dict]], matmul_tflops: float, gbps: float) -> str:
    """rows: (workload, impl, kernel_breakdown, work {"linear_flops", "attention_flops", "linear_out_bytes"})."""
    head = (f"{'workload':<12} {'impl':<30} {'total':>7} {'GEMM':>7} {'%fl':>4} {'attn':>6} {'%fl':>4} "
            f"{'elemw':>6} {'%fl':>4} {'copy':>5}")
    lines = ["kernel breakdown (device ms per call; %fl: the class's floor time / its time)", head, "-" * len(head)]
    for workload, impl, b, work in rows:
        floors = {"gemm": work["linear_flops"] / (matmul_tflops * 1e12) * 1e3,
                  "attention": work["attention_flops"] / (matmul_tflops * 1e12) * 1e3,
                  "elementwise": 2 * work["linear_out_bytes"] / (gbps * 1e9) * 1e3}

        def pct(c):
            return f"{100 * floors[c] / b[c]:.0f}" if b[c] > 0 else "-"
        lines.append(f"{workload:<12} {impl[:30]:<30} {b['total']:>7.2f} {b['gemm']:>7.2f} {pct('gemm'):>4} "
                     f"{b['attention']:>6.2f} {pct('attention'):>4} {b['elementwise']:>6.2f} {pct('elementwise'):>4} "
                     f"{b['memcpy']:>5.2f}")
    for workload, impl, b, _ in rows:
        top = "; ".join(f"{n} {ms:.2f} ({c})" for n, ms, c in b["top"])
        lines.append(f"  {workload} {impl[:30]}: longest kernels: {top}")
    return "\n".join(lines)
