"""Encoder-attention kernels side by side: every backend usable on this machine, on vision packs.

    python benchmarks/attention_bench.py --out attn.json                # all usable backends
    python benchmarks/attention_bench.py --kernel-sweep --out sweep.json # + TRITON_ATTN configs
    python benchmarks/attention_bench.py --sweep-only --out sweep.json   # only the config sweep

Packs (bf16): "windows" = 684 x 64-token windows (Qwen2.5-VL window attention), "full" = 8 x 5476
tokens (8 images of 74x74 patches); heads: 16 x 64, 16 x 72, 16 x 80, 12 x 128.
TFLOP/s = 4 * sum(len_i^2) * H * D / time; time = median of CUDA-event timings after warm-up
(triton.testing.do_bench), on fresh random inputs. Each backend is first checked against NAIVE on
the first segments of the pack (relative error of those rows, in the table). TRITON_ATTN rows name
the config its first-call tuning chose. The sweep ends with CONFIGS entries (winner + runner-up per
(length bucket, head class)) ready to paste into mmenc/backends/kernels/triton_attn_plan.py.
"""
import argparse
import dataclasses
import functools
import json
import sys
import time

import torch

from mmenc.backends import AttentionBackendEnum, get_backend_class, make_cu_seqlens

PACKS = {"windows": [64] * 684, "full": [5476] * 8}
HEADS = [(16, 64), (16, 72), (16, 80), (12, 128)]  # (num_heads, head_size)
DEVICE = "cuda"
CHECK_SEGMENTS = {"windows": 48, "full": 1}  # segments compared with NAIVE


def bench_ms(fn, rep: int) -> float:
    try:
        from triton.testing import do_bench
    except ImportError:
        return _events_ms(fn, rep)
    return do_bench(fn, warmup=10, rep=rep, return_mode="median")


def _events_ms(fn, rep: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(max(5, rep // 5)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def make_inputs(lengths, heads, d, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    t = sum(lengths)
    q, k, v = (torch.randn(t, heads, d, device=DEVICE, dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cu, max_seqlen = make_cu_seqlens(lengths, DEVICE)
    return q, k, v, cu, max_seqlen


class Reference:
    """NAIVE on the first segments of a pack; rel_err(out) compares those rows of `out`."""

    def __init__(self, q, k, v, lengths, n_segments, scale):
        sub = lengths[:n_segments]
        self.rows = sum(sub)
        cu, max_seqlen = make_cu_seqlens(sub, DEVICE)
        naive = get_backend_class(AttentionBackendEnum.NAIVE)
        self.ref = naive.forward(q[:self.rows], k[:self.rows], v[:self.rows], cu, max_seqlen, scale).float()

    def rel_err(self, out) -> float:
        diff = out[:self.rows].float() - self.ref
        return (diff.norm() / self.ref.norm()).item()


def flops(lengths, heads, d) -> float:
    return 4.0 * sum(n * n for n in lengths) * heads * d


def usable_backends(d, only):
    from mmenc.platforms import current_platform

    rows = current_platform.explain_vit_attn_backends(d, torch.bfloat16)
    names = [r.backend for r in rows if r.usable and (not only or r.backend.name in only)]
    return names, {r.backend.name: list(r.reasons) for r in rows if not r.usable}


def run_backends(args, results):
    print(f"{'pack':8} {'H x D':8} {'backend':15} {'ms':>9} {'TFLOP/s':>8} {'rel err':>9}  config")
    for pack, lengths in PACKS.items():
        for heads, d in HEADS:
            backends, skipped = usable_backends(d, args.backends)
            scale = d ** -0.5
            check = make_inputs(lengths, heads, d, seed=d)
            ref = Reference(*check[:3], lengths, CHECK_SEGMENTS[pack], scale)
            for i, backend in enumerate(backends):
                row = {"pack": pack, "heads": heads, "head_size": d, "backend": backend.name}
                cls = get_backend_class(backend)
                try:
                    row["rel_err"] = ref.rel_err(cls.forward(*check, scale))
                    q, k, v, cu, mx = make_inputs(lengths, heads, d, seed=1000 * (i + 1) + d)  # fresh inputs
                    rep = 20 if backend is AttentionBackendEnum.NAIVE else args.rep
                    row["ms"] = bench_ms(functools.partial(cls.forward, q, k, v, cu, mx, scale), rep)
                    row["tflops"] = flops(lengths, heads, d) / row["ms"] / 1e9
                    if backend is AttentionBackendEnum.TRITON_ATTN:
                        row["config"] = str(_triton_config(q, k, mx))
                except Exception as e:  # noqa: BLE001 - a failing backend is reported, the others still run
                    row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                results["backends"].append(row)
                _print_row(row)
                save(args, results)
            results["skipped"][f"{pack}/{heads}x{d}"] = skipped
            del check, ref
            torch.cuda.empty_cache()


def _print_row(row):
    name = f"{row['heads']}x{row['head_size']}"
    if "error" in row:
        print(f"{row['pack']:8} {name:8} {row['backend']:15} ERROR {row['error']}", flush=True)
    else:
        print(f"{row['pack']:8} {name:8} {row['backend']:15} {row['ms']:9.3f} {row['tflops']:8.1f} "
              f"{row['rel_err']:9.2e}  {row.get('config', '')}", flush=True)


def _triton_config(q, k, max_seqlen):
    from mmenc.backends.kernels import triton_varlen_attn as tva

    chosen = tva.chosen_config(q, k, max_seqlen)
    return chosen or tva.candidates(q.shape[2], max_seqlen)[0]  # one candidate: nothing was timed


def sweep_configs(pack, d):
    """The grid for one pack: windows-kernel variants + a few tile configs for "windows", tile configs
    (pointer and TMA loads) for "full"; "-pad" where the head split matters. ~9-14 configs each, so the
    whole sweep (4 head sizes x 2 packs) compiles and times in about 2-3 minutes."""
    from mmenc.backends.kernels.triton_varlen_attn import KernelConfig as K
    from mmenc.backends.kernels.triton_varlen_attn import head_split

    if pack == "windows":
        grid = [K(64, 64, 4, 2, windows=n) for n in (2, 4, 8)] + [K(64, 64, 4, 3, windows=n) for n in (4, 8)]
        grid += [K(64, 64, 4, 4, windows=8), K(64, 64, 4, 2, tma=True), K(64, 64, 4, 2), K(128, 64, 8, 2, tma=True)]
        grid += [K(64, 64, 2, 2, windows=4), K(64, 64, 2, 3, windows=8), K(64, 64, 4, 3, windows=16),
                 K(64, 64, 4, 4, windows=4), K(64, 64, 4, 3, windows=2)]
    else:
        grid = [K(128, 64, 8, 3, tma=True), K(128, 64, 8, 3), K(128, 64, 8, 2, tma=True), K(128, 128, 8, 2, tma=True),
                K(128, 128, 8, 3, tma=True), K(64, 64, 4, 3, tma=True)]
        if d < 128:
            grid.append(K(128, 64, 4, 3, tma=True))  # spills at d=128 (255 registers, sm_90 AOT compile)
        if head_split(d) != head_split(d, split=False):
            grid.append(K(128, 64, 8, 3, split=False, tma=True))
    return grid


def run_sweep(args, results):
    from mmenc.backends.kernels import triton_varlen_attn as tva

    print("\nTRITON_ATTN config sweep: m<BLOCK_M>n<BLOCK_N>w<warps>s<stages>[-pad: head dim padded, not split]"
          "[-tma][-win<n>: windows kernel, n windows per program], fastest first, TFLOP/s")
    for pack, lengths in PACKS.items():
        for heads, d in HEADS:
            scale = d ** -0.5
            q, k, v, cu, mx = make_inputs(lengths, heads, d, seed=7 * d)
            ref = Reference(q, k, v, lengths, CHECK_SEGMENTS[pack], scale)
            out = torch.empty_like(q)
            rows = []
            for config in sweep_configs(pack, d):
                row = {"pack": pack, "heads": heads, "head_size": d, "config": str(config),
                       "code": config_code(config), "bucket": tva.length_bucket(mx), "head_class": tva.head_class(d)}
                try:
                    row["rel_err"] = ref.rel_err(tva.launch(q, k, v, cu, scale, config, out))
                    row["ms"] = bench_ms(functools.partial(tva.launch, q, k, v, cu, scale, config, out), args.rep)
                    row["tflops"] = flops(lengths, heads, d) / row["ms"] / 1e9
                except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
            results["sweep"] += rows
            save(args, results)
            ok = sorted((r for r in rows if "ms" in r and r["rel_err"] <= 2e-2), key=lambda r: r["ms"])
            summary = "  ".join(f"{r['config']} {r['tflops']:.0f}" for r in ok[:4])
            bad = [r["config"] for r in rows if "error" in r or r.get("rel_err", 0) > 2e-2]
            print(f"{pack:8} {heads}x{d:<5} best: {summary}" + (f"  FAILED: {bad}" if bad else ""), flush=True)
            del q, k, v, ref, out
            torch.cuda.empty_cache()
    results["configs_code"] = configs_code(results["sweep"])
    print("\nCONFIGS entries from this sweep (paste into mmenc/backends/kernels/triton_attn_plan.py; \"mid\" is not"
          " measured here):\n" + results["configs_code"])


def config_code(config) -> str:
    """`_K(...)` as written in CONFIGS: the four shape fields, then the fields that differ from the default."""
    from mmenc.backends.kernels.triton_varlen_attn import KernelConfig

    shape = [str(x) for x in (config.block_m, config.block_n, config.num_warps, config.num_stages)]
    extra = [f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(KernelConfig)[4:]
             if getattr(config, f.name) != f.default]
    return f"_K({', '.join(shape + extra)})"


def configs_code(sweep_rows) -> str:
    """Per (bucket, head class): the two configs with the best mean relative speed (best ms / ms, 0 when
    failed or wrong) over the head sizes of that class, as CONFIGS lines."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in sweep_rows:
        groups.setdefault((r["bucket"], r["head_class"]), {}).setdefault(r["head_size"], {})[r["code"]] = r
    lines = []
    for key, by_size in sorted(groups.items()):
        score: dict[str, float] = {}
        for rows in by_size.values():
            good = {c: r["ms"] for c, r in rows.items() if "ms" in r and r["rel_err"] <= 2e-2}
            best = min(good.values(), default=None)
            for c in rows:
                score[c] = score.get(c, 0.0) + (best / good[c] if c in good else 0.0) / len(by_size)
        top = sorted(score, key=score.get, reverse=True)[:2]
        tflops = " / ".join(f"{max(rows[c]['tflops'] for rows in by_size.values() if 'tflops' in rows.get(c, {})):.0f}"
                            for c in top if any('tflops' in rows.get(c, {}) for rows in by_size.values()))
        lines.append(f"    {key!r}: [{', '.join(top)}],  # sizes {sorted(by_size)}: {tflops} TFLOP/s")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--kernel-sweep", action="store_true", help="also time TRITON_ATTN's config variants")
    parser.add_argument("--sweep-only", action="store_true", help="only the TRITON_ATTN config sweep")
    parser.add_argument("--backends", type=lambda s: {b.strip().upper() for b in s.split(",")},
                        help="comma-separated backend names to time (default: every usable one)")
    parser.add_argument("--rep", type=int, default=50, help="milliseconds of timed repetitions per measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("attention_bench.py needs a CUDA GPU")
    started = time.time()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
               "backends": [], "skipped": {}, "sweep": []}
    try:
        import triton
        results["triton"] = triton.__version__
    except ImportError:
        results["triton"] = None
    if not args.sweep_only:
        run_backends(args, results)
    if args.kernel_sweep or args.sweep_only:
        run_sweep(args, results)
    results["seconds"] = round(time.time() - started, 1)
    print(f"done in {results['seconds']} s")
    save(args, results)


def save(args, results):
    """Written after every measurement, so a crash (e.g. a config that faults) keeps what was done."""
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
