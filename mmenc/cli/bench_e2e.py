"""`mmenc bench --e2e` and `mmenc bench --video` (the end-to-end runs of mmenc.cli.bench): image files and
video files through Encoder.encode, against transformers' processors and tower, from the Encoder that
`mmenc bench` built (mmenc.bench.e2e, mmenc.bench.video do the measuring).
"""
import math
import pathlib
import sys

import numpy as np
import torch

from mmenc.cli.common import write_json_atomically


def run_video_bench(args, encoder, hf, json_path) -> int:
    """`mmenc bench --video` (mmenc.bench.video): one clip and a batch of clips end to end, and the peaks."""
    import tempfile

    from mmenc.bench.video import run_video

    if args.preprocess_workers is not None:  # the video rows' workers (a scaling run: 1, 2, 4, ... of them)
        encoder.replace_preprocessor(args.preprocess_workers)
    pre = encoder.preprocessor
    print(f"mmenc bench --video: preprocessing: {pre.workers} {pre.worker_kind} workers, resize={pre.resize}",
          file=sys.stderr)
    width, height = (int(x) for x in args.video_size.lower().split("x"))
    lengths = [float(x) for x in args.video_lengths.split(",") if x]
    with tempfile.TemporaryDirectory() as tmp:
        run_video(encoder, hf, seconds=args.video_seconds, size=(height, width), fps=args.video_fps,
                  batch=args.video_batch, lengths=lengths, folder=pathlib.Path(args.video_dir or tmp),
                  warmup=min(args.warmup, 2), iters=max(1, min(args.iters, 3)), json_path=json_path)
    return 0


def run_e2e(args, encoder, workloads: dict, hf, json_path) -> int:
    """`mmenc bench --e2e` (mmenc.bench.e2e): the table, the stream, the invariance probe."""
    import tempfile

    from mmenc.bench import e2e
    from mmenc.bench.trace import format_trace

    loaded, device = encoder.loaded, encoder.device
    if args.preprocess_workers is not None or args.preprocess_decode != "auto":
        encoder.replace_preprocessor(args.preprocess_workers, args.preprocess_decode)
    patch = getattr(encoder.processor.config, "patch_size", 14)
    gpu = device.type == "cuda"
    stream_n = args.stream_images if args.stream_images is not None else (2000 if gpu else 12)
    if stream_n < 0:
        raise ValueError(f"--stream-images={stream_n} must be >= 0 (0: no stream case)")
    rows, summaries, stream = [], [], None
    with tempfile.TemporaryDirectory(prefix="mmenc-e2e-") as tmp:
        folder = pathlib.Path(tmp)
        hf_proc = None
        if not args.no_hf:
            model_type = loaded.hf_config.get("model_type", "?")
            try:
                hf_proc = e2e.hf_image_processor(model_type, loaded.processor_settings, folder / "hf")
            except (ValueError, OSError, ImportError, KeyError) as err:
                print(f"mmenc bench: transformers' image processor for {model_type!r} skipped: {err}", file=sys.stderr)
        for i, (name, grids) in enumerate(workloads.items()):
            paths = e2e.write_jpegs(folder / f"w{i}", e2e.image_sizes(grids, patch), seed=i)
            print(f"mmenc bench: e2e {name}: {len(paths)} JPEG files ...", file=sys.stderr, flush=True)
            got, summary = e2e.run_workload(name, encoder, paths, hf_proc, hf, args.warmup, args.iters)
            print(e2e.format_rows(got), file=sys.stderr, flush=True)  # progress: survives a cut run
            print(format_trace(f"{name} encode trace", summary["encode_trace"]), file=sys.stderr, flush=True)
            if "transformers_skipped" in summary:
                print(f"mmenc bench: e2e {name}: transformers' rows skipped: {summary['transformers_skipped']}",
                      file=sys.stderr, flush=True)
            rows += got
            summaries.append(summary)
        if stream_n:
            side = max(max(h, w) for grids in workloads.values() for _, h, w in grids) * patch
            rng = np.random.default_rng(7)
            sizes = [tuple(int(x) for x in rng.integers(max(side // 4, 2 * patch), side + 1, 2))
                     for _ in range(min(stream_n, 64))]
            pool = e2e.write_jpegs(folder / "stream", sizes, seed=99)
            print(f"mmenc bench: e2e stream: {stream_n} images over {len(pool)} mixed-size files ...",
                  file=sys.stderr, flush=True)
            stream = e2e.run_stream(encoder, pool, stream_n)
            print(format_trace("stream trace", stream["trace"]), file=sys.stderr, flush=True)
    small, large = ((1, 16, 16), (1, 74, 74)) if gpu else ((1, 8, 8), (1, 24, 24))
    try:
        invariance = e2e.invariance_probe(encoder, small, large)
    except ValueError as err:  # a tower of fixed tiles or anyres rows: the smallest and largest rows its files gave
        seen = sorted((tuple(r) for s in summaries for r in s["grid_rows"]), key=lambda r: math.prod(r[:3]))
        print(f"mmenc bench: invariance probe on the files' grids {list(seen[0])} and {list(seen[-1])} "
              f"({str(err).splitlines()[0][:160]})", file=sys.stderr)
        invariance = e2e.invariance_probe(encoder, seen[0], seen[-1])
    print(f"model={encoder.model_name} dtype={str(loaded.dtype).removeprefix('torch.')} device={device} "
          f"torch={torch.__version__} preprocess_workers={encoder.preprocessor.workers} "
          f"decode={encoder.preprocessor.decode} resize={encoder.preprocessor.resize} "
          f"worker_kind={encoder.preprocessor.worker_kind} "
          f"hf_processor={type(hf_proc).__name__ if hf_proc is not None else None}"
          + (f" gpu={torch.cuda.get_device_name(device)}" if gpu else ""))
    print(e2e.format_rows(rows))
    for s in summaries:
        print(f"{s['workload']}: preprocessing share {100 * s['preprocess_share']:.0f}%" + (
            f"; grids equal to transformers: {s['grids_equal_transformers']}" if "grids_equal_transformers" in s else "")
            + (f"; pixel max diff vs transformers {s['pixels_max_diff_vs_transformers']:.3g}"
               if "pixels_max_diff_vs_transformers" in s else ""))
        print(format_trace(f"{s['workload']} encode trace", s["encode_trace"]))
    if stream is not None:
        print(f"stream: {stream['images']} images ({stream['failed']} failed) in {stream['wall_s']:.2f} s = "
              f"{stream['images_per_s']:.1f} img/s; tower {stream['tower_s']:.2f} s = "
              f"{stream['tower_only_images_per_s']:.1f} img/s; GPU busy {100 * stream['gpu_busy_fraction']:.0f}%"
              + f"; tower alone over the same packings {stream['tower_same_packings_s']:.2f} s "
              f"(stream at {100 * stream['vs_tower_same_packings']:.0f}% of it)"
              + (f"; CUDA graph calls {stream['graph_calls']}" if stream.get("graph_calls") else ""))
        print(format_trace("stream trace", stream["trace"]))
    print("invariance (an image of grid {} alone vs in mixed batches, max |diff|): {} (largest |value| {:.3g})".format(
        "x".join(map(str, invariance["small_grid"])),
        ", ".join(f"{k}: {v:.3g}" for k, v in invariance["max_abs_diff"].items()),
        invariance["max_abs_value"]))
    if json_path is not None:
        payload = {"model": encoder.model_name, "dtype": str(loaded.dtype), "device": str(device),
                   "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device) if gpu else None,
                   "compile": encoder.mm_config.compile, "cuda_graphs": encoder.mm_config.cuda_graphs,
                   "max_batch_patches": encoder.max_batch_patches, "first_chunk_patches": encoder.first_chunk_patches,
                   "chunk_growth": encoder.chunk_growth, "chunks_in_flight": encoder.chunks_in_flight,
                   "graph_recent_calls": encoder.graph_recent_calls,
                   "preprocess_workers": encoder.preprocessor.workers, "decode": encoder.preprocessor.decode,
                   "resize": encoder.preprocessor.resize, "worker_kind": encoder.preprocessor.worker_kind,
                   "hf_processor": type(hf_proc).__name__ if hf_proc is not None else None,
                   "rows": [dict(vars(r), images_per_s=r.images_per_s) for r in rows], "workloads": summaries,
                   "stream": stream, "invariance": invariance}
        write_json_atomically(json_path, payload)
    encoder.close()
    return 0
