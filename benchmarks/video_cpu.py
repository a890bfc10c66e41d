"""Video preprocessing on the CPU: mmenc against transformers' video processor, from the same H.264 file.

    python benchmarks/video_cpu.py [--seconds 10] [--size 1280x720] [--fps 2] [--reps 5] [--workers 1 2]

Rows (median of --reps, interleaved so that a change in the machine's load hits all alike), each from
the file to pixel_values on the CPU, sampled at --fps:
  transformers            its PyAV reader (transformers.video_utils.read_video_pyav: decodes from the start,
                          converts the sampled frames) + its video processor (Qwen2VLVideoProcessor /
                          Qwen3VLVideoProcessor), torch's default threads
  mmenc sequential        mmenc's VideoProcessor on the whole file in the calling thread (same algorithm)
  mmenc pipeline wN       Preprocessor.iter_chunks([Video]) with N worker threads (Encoder.encode's pipeline):
                          pieces of 16384 rows, each decoded (seeking to its key frame) in parallel
It checks that the pixel values are equal first. Needs torchvision for transformers' side (the venv of
tests/test_video_parity.py). The clip is written once into --dir (PyAV, libx264).
"""
import argparse
import pathlib
import statistics
import tempfile
import time

import torch

from mmenc.preprocess import get_processor
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.video import Video
from mmenc.preprocess.video_decode import probe
from mmenc.preprocess.video_families import get_video_processor
from mmenc.preprocess.video_sampling import VideoOptions
from mmenc.testing.clips import write_clip
from mmenc.testing.hf_video import quiet_kwargs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--size", default="1280x720")
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--kind", default="qwen2_5_vl", choices=["qwen2_5_vl", "qwen3_vl"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dir", default=None)
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    folder = pathlib.Path(args.dir or tempfile.mkdtemp())
    clip = folder / f"cpu-{args.seconds:g}s-{width}x{height}.mp4"
    if not clip.exists():
        write_clip(clip, frames=int(args.seconds * 30), size=(height, width), fps=30, seed=1)
    options = VideoOptions(fps=args.fps)
    vp = get_video_processor(args.kind)
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    from transformers.video_utils import read_video_pyav

    hf = (Qwen2VLVideoProcessor if args.kind == "qwen2_5_vl" else Qwen3VLVideoProcessor)()

    def transformers_side():
        frames, meta = read_video_pyav(str(clip), lambda metadata, **_: hf.sample_frames(metadata, fps=args.fps))
        return hf(videos=[frames], do_sample_frames=False, return_tensors="pt",
                  **quiet_kwargs(hf))["pixel_values_videos"]

    cases = {"transformers": transformers_side, "mmenc sequential": lambda: vp(clip, options)[0]}
    pipelines = {}
    for n in args.workers:
        pipelines[n] = Preprocessor(get_processor(args.kind), workers=n, worker_kind="thread", video_processor=vp)
        cases[f"mmenc pipeline w{n}"] = (lambda pre: lambda: torch.cat([  # pieces of 16384 rows, as Encoder.encode
            c.pixel_values for c in pre.iter_chunks([Video(clip, fps=args.fps)], max_batch_patches=1 << 16)]))(
            pipelines[n])
    reference = cases["transformers"]()
    for name, fn in cases.items():
        out = fn()
        assert torch.equal(out.reshape(reference.shape), reference), f"{name}: pixel values differ from transformers'"
    times = {name: [] for name in cases}
    for _ in range(args.reps):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1000)
    n_frames = len(vp.plan(probe(clip), options).indices)
    print(f"{clip.name}: {n_frames} frames sampled at {args.fps:g} fps, {reference.shape[0]} rows, torch threads "
          f"{torch.get_num_threads()}, {args.reps} reps (equal pixel values checked)")
    base = statistics.median(times["transformers"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"  {name:<22} {ms:9.1f} ms  {n_frames / ms * 1000:7.1f} frames/s  {base / ms:5.2f}x transformers")
    for pre in pipelines.values():
        pre.close()


if __name__ == "__main__":
    main()
