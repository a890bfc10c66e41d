"""What FlashAttention-4's first use costs: per shape class (dtype, head size, GQA group), the first
call (JIT compilation) against the steady state, and a first call on new segment lengths of an
already-compiled class (should cost no compilation). Through mmenc's FLASH_ATTN backend.

    python benchmarks/fa4_first_use.py [--json out.json]
"""
import argparse
import json
import sys
import time

import torch

from mmenc.backends import AttentionBackendEnum, get_backend_class, make_cu_seqlens

CLASSES = [(torch.bfloat16, 64, 16, 16), (torch.bfloat16, 72, 16, 16), (torch.bfloat16, 80, 16, 16),
           (torch.bfloat16, 128, 12, 12), (torch.bfloat16, 80, 16, 4), (torch.float16, 80, 16, 16)]


def call_s(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    backend = get_backend_class(AttentionBackendEnum.FLASH_ATTN)
    print(f"FLASH_ATTN implementation: {backend.version()}", flush=True)
    rows = []
    for dtype, d, hq, hkv in CLASSES:
        def run(lengths):
            t = sum(lengths)
            q = torch.randn(t, hq, d, device="cuda", dtype=dtype)
            k, v = (torch.randn(t, hkv, d, device="cuda", dtype=dtype) for _ in range(2))
            cu, mx = make_cu_seqlens(lengths, "cuda")
            return lambda: backend.forward(q, k, v, cu, mx, d ** -0.5)
        first = call_s(run([1024] * 4))
        steady = min(call_s(run([1024] * 4)) for _ in range(3))
        new_lengths = call_s(run([5476, 3000, 77, 1]))
        row = dict(dtype=str(dtype).removeprefix("torch."), head_size=d, heads=hq, kv_heads=hkv,
                   first_s=first, steady_s=steady, first_on_new_lengths_s=new_lengths)
        rows.append(row)
        print(f"{row['dtype']:<9} d={d:<4} {hq}/{hkv} heads  first {first:7.2f} s  steady {steady * 1e3:7.2f} ms  "
              f"new lengths {new_lengths * 1e3:7.2f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
