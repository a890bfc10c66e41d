"""What batch-invariant mode costs, part by part (issue 11): Qwen2.5-VL-7B's tower, random weights.

    PYTHONPATH=. python benchmarks/invariant_cost.py --json inv_cost.json      # CUDA, < 4 min on an H200
    PYTHONPATH=. python benchmarks/invariant_cost.py --tiny                    # CPU smoke run (tiny tower)

Variants (each a fresh Encoder; knobs applied after it is built, before its first call):
  default            MultiModalConfig() as it is
  invariant          batch_invariant=True as it is (token tiles of TOKEN_TILE; windows through
                     TRITON_ATTN's fixed-config path at once, long segments in fixed-shape sub-packs)
  inv-sdpa           invariant, with TRITON_ATTN refused (the windows in SDPA sub-packs: the old mode)
  inv-triton-chunks  invariant, with TRITON_ATTN's fixed-config path run on fixed-shape padded chunks
  tiles-N            default + only the token tiles, N tokens per GEMM call (every other size of
                     the sweep; the per-op table has them all)
  subpacks           batch_invariant=True with the token tiles off (invariant attention only)
  subpacks-sdpa      the same with TRITON_ATTN refused (the old invariant attention only)
  inv-tiles-N        batch_invariant=True with N-token tiles
  inv-gemm-triton    batch_invariant=True with mmenc.layers.invariant_gemm's Triton GEMM instead of
                     token tiles (CUDA)
  gemm-triton        default + only that GEMM (CUDA)
  inv-uniform        invariant with one tile size for every linear (no NARROW_TOKEN_TILE)
  inv-narrow-16384   invariant with 16384-row tiles for the narrow linears
  inv-unaligned      invariant with uniform tiles and unaligned rows not padded (the linears of GPU run 8a)
  inv-triton-all     invariant with TRITON_ATTN for every segment (full layers too) (CUDA)
Modes: eager (on CUDA only default, invariant and inv-sdpa); graphs (eager + CUDA graphs: no launch
overhead, no compile time); compiled (torch.compile + CUDA graphs, only the variants in --compiled,
since each compiles the block anew). Variants on kernels new in this branch run after the others.
Then per-op timings on the tower's real inputs: one window layer's and one full layer's attention
call (default choice, invariant, invariant on chunks, the old SDPA sub-packs) and each linear shape:
F.linear vs tiled_linear per tile size vs the Triton GEMM (per launch config).
Timing: CUDA events after warm-up, median (perf_counter on CPU); eager passes: 1 warm-up call,
iters - 2 timed.
The table comes last; --json PATH writes every row.
"""
import argparse
import contextlib
import gc
import json
import sys
import tempfile
import time
import traceback

import torch
import torch.nn.functional as F

from mmenc.backends.dispatch import attend
from mmenc.backends.triton_attn import TritonAttnBackend
from mmenc.bench.measure import WORKLOADS, random_pixels, time_ms
from mmenc.engine.encoder import Encoder
from mmenc.layers import token_tiles
from mmenc.layers.invariant_gemm import GemmConfig
from mmenc.layers.linear import LinearBase
from mmenc.layers.linear_kernels import use_token_tiles
from mmenc.layers.token_tiles import TOKEN_TILE, TRITON_GEMM, tiled_linear

MODEL = "Qwen/Qwen2.5-VL-7B-Instruct"
GPU_WORKLOADS = ("8x1036px", "32x448px")
TINY_WORKLOADS = {"tiny-2x16": [(1, 16, 16)] * 2, "tiny-4x8": [(1, 8, 8)] * 4}
SWEEP = (4096, 8192, 16384, 32768, 65536)
# Triton GEMM launch configs timed per linear shape (the ops table's gemm-triton* rows); the first is CONFIG.
GEMM_CONFIGS = [GemmConfig(128, 128, 64, 8, 8, 3), GemmConfig(128, 256, 64, 8, 8, 3), GemmConfig(128, 128, 64, 8, 4, 4),
                GemmConfig(128, 256, 64, 8, 8, 4), GemmConfig(64, 128, 64, 8, 4, 4)]
KEEP = "keep"  # tile knob: leave what the config set


def variants(sweep) -> dict[str, dict]:
    # eager=False: CUDA graphs mode only (saves time; eager adds launch overhead, measured on the first three)
    v = {"default": dict(bi=False, tile=KEEP), "invariant": dict(bi=True, tile=KEEP),
         "inv-sdpa": dict(bi=True, tile=KEEP, attn="sdpa"),
         "inv-triton-chunks": dict(bi=True, tile=KEEP, attn="chunks", eager=False)}
    v.update({f"tiles-{n}": dict(bi=False, tile=n, eager=False) for n in sweep[::2]})  # the ops table has every size
    v["subpacks"] = dict(bi=True, tile=None, eager=False)
    v["subpacks-sdpa"] = dict(bi=True, tile=None, attn="sdpa", eager=False)
    v.update({f"inv-tiles-{n}": dict(bi=True, tile=n, eager=False) for n in sweep[2::2] if n != TOKEN_TILE})
    v["inv-gemm-triton"] = dict(bi=True, tile=TRITON_GEMM, cuda=True, eager=False)
    v["gemm-triton"] = dict(bi=False, tile=TRITON_GEMM, cuda=True, eager=False)
    # the linears' two refinements, one at a time (compare in --compiled): uniform tiles (no narrow
    # tile), and the GPU run 8a linears (uniform 4096-row tiles, unaligned 3420-wide rows left as they are)
    v["inv-uniform"] = dict(bi=True, tile=TOKEN_TILE, narrow=None, eager=False)
    v["inv-narrow-16384"] = dict(bi=True, tile=TOKEN_TILE, narrow=16384, eager=False)
    v["inv-unaligned"] = dict(bi=True, tile=TOKEN_TILE, narrow=None, align=False, eager=False)
    # every segment through TRITON_ATTN's invariant path (mm_encoder_attn_backend), the full layers too
    v["inv-triton-all"] = dict(bi=True, tile=KEEP, backend="TRITON_ATTN", cuda=True, eager=False)
    return v


def new_path(spec: dict) -> bool:
    """Whether a variant runs kernels new in this branch (TRITON_ATTN's fixed-config path, the Triton GEMM)."""
    return (spec["bi"] and spec.get("attn") != "sdpa") or spec["tile"] == TRITON_GEMM


@contextlib.contextmanager
def triton_knobs(attn: str):
    """attn "sdpa": TRITON_ATTN refused while the layers choose (the old invariant mode); "chunks": its
    fixed-config path run on fixed-shape chunks (not shape-independent) while timing; "auto": as it is."""
    refuse, whole = TritonAttnBackend.not_batch_invariant, TritonAttnBackend.shape_independent
    if attn == "sdpa":
        TritonAttnBackend.not_batch_invariant = "refused by benchmarks/invariant_cost.py (inv-sdpa)"
    if attn == "chunks":
        TritonAttnBackend.shape_independent = False
    try:
        yield
    finally:
        TritonAttnBackend.not_batch_invariant, TritonAttnBackend.shape_independent = refuse, whole


def build(model: str, device: str, dtype: str, spec: dict, compile_: bool) -> Encoder:
    graphs = device == "cuda"
    with triton_knobs("sdpa" if spec.get("attn") == "sdpa" else "auto"):
        enc = Encoder(model, load_format="dummy", dtype=dtype, device=device, compile=compile_, cuda_graphs=graphs,
                      batch_invariant=spec["bi"], mm_encoder_attn_backend=spec.get("backend"))
    if spec["tile"] != KEEP:  # tiles-N and the like: one tile size for every linear unless "narrow" says
        use_token_tiles(enc.tower, spec["tile"], narrow_tile=spec.get("narrow"))
    return enc


@contextlib.contextmanager
def row_alignment(on: bool):
    """align=False variants: tiled_linear leaves unaligned rows as they are (token_tiles.ALIGN_K_BYTES = 0)."""
    old = token_tiles.ALIGN_K_BYTES
    token_tiles.ALIGN_K_BYTES = old if on else 0
    try:
        yield
    finally:
        token_tiles.ALIGN_K_BYTES = old


def attention_desc(enc: Encoder) -> str:
    descs = sorted({m.describe_backend() for m in enc.tower.modules() if hasattr(m, "describe_backend")})
    return " / ".join(descs)


def time_variant(name, spec, mode, args, inputs, device) -> list[dict]:
    t0 = time.perf_counter()
    try:
        with triton_knobs("chunks" if spec.get("attn") == "chunks" else "auto"), row_alignment(spec.get("align", True)):
            rows = _time_variant(name, spec, mode, args, inputs, device)
    except Exception as e:  # a variant that fails is reported as such; the others still run
        traceback.print_exc()
        rows = [dict(variant=name, mode=mode, workload=wl, ms=float("nan"), attention=f"FAILED: {e!r}"[:120],
                     tile=None) for wl in inputs]
    print(f"  {name} [{mode}] built+timed in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    gc.collect()  # compiled blocks hold themselves through functools.partial: free the tower now
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    return rows


def _time_variant(name, spec, mode, args, inputs, device) -> list[dict]:
    compile_ = mode == "compiled"
    enc = build(args.model, args.device, args.dtype, spec, compile_)
    rows = []
    graphs = enc.graph_stats() is not None
    if mode == "compiled":
        passes = [graphs]
    elif device.type == "cuda":
        passes = [False, True] if spec.get("eager", True) else [True]
    else:
        passes = [False]
    for use_graphs in passes:
        label = "compiled+graphs" if compile_ and use_graphs else ("compiled" if compile_
                                                                     else ("graphs" if use_graphs else "eager"))
        for wl, (pixels, grid) in inputs.items():
            warmup, iters = (args.warmup + 2, args.iters) if use_graphs or compile_ else (1, max(1, args.iters - 2))
            with contextlib.nullcontext() if use_graphs else enc.graphs_off():
                ms = time_ms(lambda: enc.encode_pixels(pixels, grid), device, warmup, iters)
            rows.append(dict(variant=name, mode=label, workload=wl, ms=ms, attention=attention_desc(enc),
                             tile="/".join(map(str, sorted({m.token_tile for m in enc.tower.modules()
                                                            if isinstance(m, LinearBase)}, key=str)))))
            print(f"    {name:<18} {label:<16} {wl:<10} {ms:8.2f} ms", file=sys.stderr, flush=True)
    enc.clear_graphs()
    return rows


def capture_ops(args, inputs, device) -> dict:
    """One window and one full attention call's packed inputs, and every linear's (in, out, bias), per workload."""
    enc = build(args.model, args.device, args.dtype, dict(bi=False, tile=KEEP), False)
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
        packed = tuple(t.detach().reshape(-1, h, d).contiguous() for t in (q, k, v))
        current.setdefault(("window", "full")[len(seen)], packed + (cu, int(mx), module.scale, module.choice))

    hooks = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in enc.tower.modules()
             if hasattr(m, "describe_backend") and hasattr(m, "num_heads")]
    linears = sorted({(m.weight.shape[1], m.weight.shape[0], m.bias is not None)
                      for m in enc.tower.modules() if isinstance(m, LinearBase)})
    for wl, (pixels, grid) in inputs.items():
        current = {}
        with torch.no_grad(), enc.graphs_off():
            enc.encode_pixels(pixels, grid)
        got[wl] = dict(current, tokens=int(grid.prod(-1).sum()))
    for h in hooks:
        h.remove()
    return dict(per_workload=got, linears=linears, dtype=enc.dtype)


def time_ops(ops: dict, args, device) -> list[dict]:
    from mmenc.backends import BackendChoice
    from mmenc.backends import AttentionBackendEnum as B

    rows = []
    for wl, cap in ops["per_workload"].items():
        for kind in ("window", "full"):
            if kind not in cap:
                continue
            q, k, v, cu, mx, scale, choice = cap[kind]
            main = choice.main if choice.main != B.TRITON_ATTN else B.TORCH_SDPA
            sdpa = BackendChoice(main, None, choice.short_seqlen_max, True)
            cands = {"default": (choice, "auto")}
            if device.type == "cuda":  # what the platform picks in invariant mode on CUDA (TRITON_ATTN for windows)
                triton = BackendChoice(main, B.TRITON_ATTN, choice.short_seqlen_max, True)
                cands.update({"invariant": (triton, "auto"), "inv-triton-chunks": (triton, "chunks")})
            cands["inv-sdpa"] = (sdpa, "auto")
            for label, (c, knob) in cands.items():
                try:
                    with triton_knobs(knob):
                        ms = time_ms(lambda: attend(q, k, v, cu, mx, scale, c), device, args.warmup, args.iters)
                except Exception as e:  # reported in the table; the other rows still run
                    traceback.print_exc()
                    ms, c = float("nan"), f"FAILED: {e!r}"[:100]
                rows.append(dict(op=f"attn-{kind}", variant=label, workload=wl, ms=ms,
                                 detail=c if isinstance(c, str) else c.describe()))
        t = cap["tokens"]
        for n_in, n_out, bias in ops["linears"]:
            x = torch.randn(t, n_in, device=device, dtype=ops["dtype"])
            w = torch.randn(n_out, n_in, device=device, dtype=ops["dtype"]) * 0.02
            b = torch.zeros(n_out, device=device, dtype=ops["dtype"]) if bias else None
            shape = f"{n_in}->{n_out}"
            rows.append(dict(op=f"linear {shape}", variant="default", workload=wl,
                             ms=time_ms(lambda: F.linear(x, w, b), device, args.warmup, args.iters), detail=""))
            for tile in [*args.sweep, *([TRITON_GEMM] if device.type == "cuda" else [])]:
                try:
                    ms = time_ms(lambda: tiled_linear(x, w, b, tile), device, args.warmup, args.iters)
                except Exception:  # reported in the table; the other rows still run
                    traceback.print_exc()
                    ms = float("nan")
                rows.append(dict(op=f"linear {shape}", variant=f"tiles-{tile}" if tile else "gemm-triton", workload=wl,
                                 ms=ms, detail=""))
            for config in (GEMM_CONFIGS if device.type == "cuda" else ()):
                from mmenc.layers.invariant_gemm import invariant_linear

                try:
                    ms = time_ms(lambda: invariant_linear(x, w, b, config), device, args.warmup, args.iters)
                except Exception:  # reported in the table; the other rows still run
                    traceback.print_exc()
                    ms = float("nan")
                rows.append(dict(op=f"linear {shape}", variant="gemm-triton*", workload=wl, ms=ms,
                                 detail=f"m{config.block_m}n{config.block_n}k{config.block_k}w{config.num_warps}"
                                        f"s{config.num_stages}"))
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run on a tiny random Qwen2.5-VL checkpoint")
    p.add_argument("--json", default=None, metavar="PATH")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--variants", default=None,
                   help="comma list run eager / with CUDA graphs (default: all; '' for none); see the module docstring")
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
    if args.variants is None:  # all that this device runs
        chosen = [n for n in table if device.type == "cuda" or not table[n].get("cuda")]
    else:  # "" for none (e.g. --compiled only)
        chosen = [n for n in args.variants.split(",") if n]
    compiled = [n for n in (args.compiled.split(",") if args.compiled else []) if n]
    unknown = [n for n in chosen + compiled if n not in table]
    if unknown:
        raise SystemExit(f"--variants/--compiled: unknown {unknown}; expected names from {list(table)}")
    compiled = [n for n in compiled if device.type == "cuda" or not table[n].get("cuda")]  # CUDA-only variants
    probe = build(args.model, args.device, args.dtype, dict(bi=False, tile=KEEP), False)
    channels, dtype = probe.tower.config.patch_features, probe.dtype
    del probe
    torch.manual_seed(0)
    inputs = {wl: random_pixels(g, channels, device, dtype) for wl, g in workloads.items()}
    t_start = time.perf_counter()
    rows = []
    mode = "eager+graphs" if device.type == "cuda" else "eager"
    op_rows = []

    def dump():  # after every stage, so a run cut short still leaves its rows
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows, ops=op_rows, total_s=time.perf_counter() - t_start,
                               torch=torch.__version__), f, indent=1)

    # Variants on paths that existed before this script first ran on a GPU come first, so that a
    # failing new kernel (a sticky CUDA error) cannot take their numbers with it.
    stages = [(n, mode) for n in chosen if not new_path(table[n])] + \
             [(n, "compiled") for n in compiled if not new_path(table[n])] + \
             [(n, mode) for n in chosen if new_path(table[n])] + [("ops", "")] + \
             [(n, "compiled") for n in compiled if new_path(table[n])]
    for name, how in stages:
        if name == "ops":
            op_rows = [] if args.no_ops else time_ops(capture_ops(args, inputs, device), args, device)
        else:
            rows += time_variant(name, table[name], how, args, inputs, device)
        dump()
    total = time.perf_counter() - t_start
    print_tables(rows, op_rows)
    print(f"total {total:.0f} s; torch {torch.__version__}; "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    if tmp is not None:
        tmp.cleanup()
    return 0


def print_tables(rows: list[dict], op_rows: list[dict]) -> None:
    base = {(r["mode"], r["workload"]): r["ms"] for r in rows if r["variant"] == "default"}
    if op_rows:
        ob = {(r["op"], r["workload"]): r["ms"] for r in op_rows if r["variant"] == "default"}
        print(f"\n{'op':<22} {'variant':<18} {'workload':<10} {'ms':>8} {'x default':>9}  detail")
        for r in op_rows:
            rel = ob.get((r["op"], r["workload"]))
            print(f"{r['op']:<22} {r['variant']:<18} {r['workload']:<10} {r['ms']:8.3f} "
                  f"{(rel / r['ms']) if rel else float('nan'):9.2f}  {r['detail']}")
    print(f"\n{'variant':<18} {'mode':<16} {'workload':<10} {'ms':>8} {'speed vs default':>16}  {'tile':<10} attention")
    for r in sorted(rows, key=lambda r: (r["workload"], r["mode"])):
        rel = base.get((r["mode"], r["workload"]))
        print(f"{r['variant']:<18} {r['mode']:<16} {r['workload']:<10} {r['ms']:8.2f} "
              f"{(rel / r['ms']) if rel else float('nan'):16.2f}  {str(r['tile']):<10} {r['attention']}")


if __name__ == "__main__":
    sys.exit(main())
