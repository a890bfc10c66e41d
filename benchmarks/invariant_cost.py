"""What batch-invariant mode costs, part by part (issue 11): Qwen2.5-VL-7B's tower, random weights.

    PYTHONPATH=. python benchmarks/invariant_cost.py --json inv_cost.json      # CUDA, < 4 min on an H200
    PYTHONPATH=. python benchmarks/invariant_cost.py --tiny                    # CPU smoke run (tiny tower)

Variants (each a fresh Encoder; knobs applied after it is built, before its first call):
  default          MultiModalConfig() as it is
  invariant        batch_invariant=True (token tiles of TOKEN_TILE + attention sub-packs)
  tiles-N          default + only the token tiles, N tokens per GEMM call
  subpacks         batch_invariant=True with the token tiles switched off (attention sub-packs only)
  inv-tiles-N      batch_invariant=True with N-token tiles
  inv-triton       batch_invariant=True with TRITON_ATTN allowed for the short (window) segments
                   (its refusal lifted while the layers choose: timing only, NOT invariant)
Modes: eager; graphs (eager + CUDA graphs: no launch overhead, no compile time); compiled (torch.compile +
CUDA graphs, only the variants in --compiled, since each compiles the block anew).
Then per-op timings on the tower's real inputs: one window layer's and one full layer's attention
call (default choice, invariant sub-packs, invariant with TRITON_ATTN) and each linear shape, plain
F.linear vs tiled_linear. Timing: CUDA events after warm-up, median (perf_counter on CPU).
The table comes last; --json PATH writes every row.
"""
import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from mmenc.backends.dispatch import attend
from mmenc.backends.triton_attn import TritonAttnBackend
from mmenc.bench.measure import WORKLOADS, random_pixels
from mmenc.engine.encoder import Encoder
from mmenc.layers.linear import _LinearBase, use_token_tiles
from mmenc.layers.token_tiles import TOKEN_TILE, tiled_linear

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
GPU_WORKLOADS = ("8x1036px", "32x448px")
TINY_WORKLOADS = {"tiny-2x16": [(1, 16, 16)] * 2, "tiny-4x8": [(1, 8, 8)] * 4}
SWEEP = (4096, 8192, 16384, 32768, 65536)
KEEP = "keep"  # tile knob: leave what the config set


def variants(sweep) -> dict[str, dict]:
    v = {"default": dict(bi=False, tile=KEEP), "invariant": dict(bi=True, tile=KEEP)}
    v.update({f"tiles-{n}": dict(bi=False, tile=n) for n in sweep})
    v["subpacks"] = dict(bi=True, tile=None)
    v.update({f"inv-tiles-{n}": dict(bi=True, tile=n) for n in sweep[2::2] if n != TOKEN_TILE})
    v["inv-triton"] = dict(bi=True, tile=KEEP, triton=True)
    return v


@contextlib.contextmanager
def triton_allowed(on: bool):
    """Lift TRITON_ATTN's batch-invariance refusal while layers choose (timing only)."""
    old = TritonAttnBackend.not_batch_invariant
    if on:
        TritonAttnBackend.not_batch_invariant = None
    try:
        yield
    finally:
        TritonAttnBackend.not_batch_invariant = old


def build(model: str, device: str, dtype: str, spec: dict, compile_: bool) -> Encoder:
    graphs = device == "cuda"
    with triton_allowed(spec.get("triton", False)):
        enc = Encoder(model, load_format="dummy", dtype=dtype, device=device, compile=compile_, cuda_graphs=graphs,
                      batch_invariant=spec["bi"])
    if spec["tile"] != KEEP:
        use_token_tiles(enc.loaded.tower, spec["tile"])
    return enc


def time_ms(fn, device: torch.device, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention_desc(enc: Encoder) -> str:
    descs = sorted({m.describe_backend() for m in enc.loaded.tower.modules() if hasattr(m, "describe_backend")})
    return " / ".join(descs)


def time_variant(name, spec, mode, args, inputs, device) -> list[dict]:
    compile_ = mode == "compiled"
    t0 = time.perf_counter()
    enc = build(args.model, args.device, args.dtype, spec, compile_)
    rows = []
    graphs = enc.loaded.graphs
    for use_graphs in ([False, True] if mode == "eager+graphs" else [mode == "compiled" and graphs is not None]):
        enc.loaded.graphs = graphs if use_graphs else None
        label = "compiled+graphs" if compile_ and use_graphs else ("compiled" if compile_
                                                                     else ("graphs" if use_graphs else "eager"))
        for wl, (pixels, grid) in inputs.items():
            ms = time_ms(lambda: enc.encode_pixels(pixels, grid), device, args.warmup + (2 if use_graphs else 0),
                         args.iters)
            rows.append(dict(variant=name, mode=label, workload=wl, ms=ms, attention=attention_desc(enc),
                             tile=next((m.token_tile for m in enc.loaded.tower.modules()
                                        if isinstance(m, _LinearBase)), None)))
            print(f"    {name:<16} {label:<16} {wl:<10} {ms:8.2f} ms", file=sys.stderr, flush=True)
    enc.loaded.graphs = graphs
    print(f"  {name} [{mode}] built+timed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    del enc, graphs
    gc.collect()  # compiled blocks hold themselves through functools.partial: free the tower now
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


def capture_ops(args, inputs, device) -> dict:
    """One window and one full attention call's packed inputs, and every linear's (in, out, bias), per workload."""
    enc = build(args.model, args.device, args.dtype, dict(bi=False, tile=KEEP), False)
    enc.loaded.graphs = None
    got: dict[str, dict] = {}
    current = {}

    def pre_hook(module, a, kw):
        q, k, v = a[:3] if len(a) >= 3 else (kw["query"], kw["key"], kw["value"])
        cu = a[3] if len(a) > 3 else kw.get("cu_seqlens")
        mx = a[4] if len(a) > 4 else kw.get("max_seqlen")
        if cu is None:
            return
        # Qwen2.5-VL: the first pack seen is the window layers' (layer 0), the second the full layers'
        seen = [key for key in ("window", "full") if key in current]
        if any(current[key][3] is cu for key in seen) or len(seen) == 2:
            return
        h, d = module.num_heads, module.head_size
        current.setdefault(("window", "full")[len(seen)], tuple(t.detach().reshape(-1, h, d).contiguous() for t in (q, k, v)) + (
            cu, int(mx), module.scale, module.choice))

    hooks = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in enc.loaded.tower.modules()
             if hasattr(m, "describe_backend") and hasattr(m, "num_heads")]
    linears = sorted({(m.weight.shape[1], m.weight.shape[0], m.bias is not None)
                      for m in enc.loaded.tower.modules() if isinstance(m, _LinearBase)})
    for wl, (pixels, grid) in inputs.items():
        current = {}
        with torch.no_grad():
            enc.encode_pixels(pixels, grid)
        got[wl] = dict(current, tokens=int(grid.prod(-1).sum()))
    for h in hooks:
        h.remove()
    return dict(per_workload=got, linears=linears, dtype=enc.loaded.dtype)


def time_ops(ops: dict, args, device) -> list[dict]:
    from mmenc.backends import BackendChoice
    from mmenc.backends import AttentionBackendEnum as B

    rows = []
    for wl, cap in ops["per_workload"].items():
        for kind in ("window", "full"):
            if kind not in cap:
                continue
            q, k, v, cu, mx, scale, choice = cap[kind]
            inv = BackendChoice(choice.main if choice.main != B.TRITON_ATTN else B.TORCH_SDPA, None,
                                choice.short_seqlen_max, True)
            cands = {"default": choice, "invariant": inv}
            if device.type == "cuda":
                cands["inv-triton"] = BackendChoice(inv.main, B.TRITON_ATTN, choice.short_seqlen_max, True)
            for label, c in cands.items():
                with triton_allowed(True):
                    ms = time_ms(lambda: attend(q, k, v, cu, mx, scale, c), device, args.warmup, args.iters)
                rows.append(dict(op=f"attn-{kind}", variant=label, workload=wl, ms=ms, detail=c.describe()))
        t = cap["tokens"]
        for n_in, n_out, bias in ops["linears"]:
            x = torch.randn(t, n_in, device=device, dtype=ops["dtype"])
            w = torch.randn(n_out, n_in, device=device, dtype=ops["dtype"]) * 0.02
            b = torch.zeros(n_out, device=device, dtype=ops["dtype"]) if bias else None
            shape = f"{n_in}->{n_out}"
            rows.append(dict(op=f"linear {shape}", variant="default", workload=wl,
                             ms=time_ms(lambda: F.linear(x, w, b), device, args.warmup, args.iters), detail=""))
            for tile in args.sweep:
                ms = time_ms(lambda: tiled_linear(x, w, b, tile), device, args.warmup, args.iters)
                rows.append(dict(op=f"linear {shape}", variant=f"tiles-{tile}", workload=wl, ms=ms, detail=""))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny random Qwen2.5-VL checkpoint")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", default=None, help="comma list (default: all); see the module docstring")
    p.add_argument("--compiled", default="default,invariant",
                   help="variants also run compiled + CUDA graphs (comma list, '' for none; default: %(default)s)")
    p.add_argument("--no-ops", action="store_true", help="skip the per-op timings")
    args = p.parse_args()
    tmp = None
    if args.tiny:
        from mmenc.testing import checkpoints as ck

        tmp = tempfile.TemporaryDirectory()
        args.model, args.device, args.dtype = str(ck.save_qwen2_5_vl(tmp.name)[0]), "cpu", "float32"
        workloads, args.sweep = TINY_WORKLOADS, (64, 256)
    else:
        if not torch.cuda.is_available():
            print("invariant_cost.py: no CUDA device; run with --tiny for the CPU smoke run", file=sys.stderr)
            return 2
        args.model, args.device, args.dtype = MODEL, "cuda", "bfloat16"
        workloads, args.sweep = {n: WORKLOADS[n] for n in GPU_WORKLOADS}, SWEEP
    device = torch.device(args.device)
    table = variants(args.sweep)
    chosen = args.variants.split(",") if args.variants else list(table)
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected names from {list(table)}")
    compiled = [n for n in (args.compiled.split(",") if args.compiled else []) if n]
    probe = build(args.model, args.device, args.dtype, dict(bi=False, tile=KEEP), False)
    cfg = probe.loaded.config
    channels = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
    dtype = probe.loaded.dtype
    del probe
    torch.manual_seed(0)
    inputs = {wl: random_pixels(g, channels, device, dtype) for wl, g in workloads.items()}
    t_start = time.perf_counter()
    rows = []
    mode = "eager+graphs" if device.type == "cuda" else "eager"
    for name in chosen:
        rows += time_variant(name, table[name], mode, args, inputs, device)
    for name in compiled:
        rows += time_variant(name, table[name], "compiled", args, inputs, device)
    op_rows = [] if args.no_ops else time_ops(capture_ops(args, inputs, device), args, device)
    total = time.perf_counter() - t_start
    print_tables(rows, op_rows)
    print(f"total {total:.0f} s; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, ops=op_rows, total_s=total, torch=torch.__version__), f, indent=1)
    if tmp is not None:
        tmp.cleanup()
    return 0


def print_tables(rows: list[dict], op_rows: list[dict]) -> None:
    base = {(r["mode"], r["workload"]): r["ms"] for r in rows if r["variant"] == "default"}
    if op_rows:
        ob = {(r["op"], r["workload"]): r["ms"] for r in op_rows if r["variant"] == "default"}
        print(f"\n{'op':<22} {'variant':<14} {'workload':<10} {'ms':>8} {'x default':>9}  detail")
        for r in op_rows:
            rel = ob.get((r["op"], r["workload"]))
            print(f"{r['op']:<22} {r['variant']:<14} {r['workload']:<10} {r['ms']:8.3f} "
                  f"{(rel / r['ms']) if rel else float('nan'):9.2f}  {r['detail']}")
    print(f"\n{'variant':<16} {'mode':<16} {'workload':<10} {'ms':>8} {'speed vs default':>16}  tile  attention")
    for r in sorted(rows, key=lambda r: (r["workload"], r["mode"])):
        rel = base.get((r["mode"], r["workload"]))
        print(f"{r['variant']:<16} {r['mode']:<16} {r['workload']:<10} {r['ms']:8.2f} "
              f"{(rel / r['ms']) if rel else float('nan'):16.2f}  {str(r['tile']):<5} {r['attention']}")


if __name__ == "__main__":
    sys.exit(main())
