"""Peak device memory of one video's encode beyond the embeddings it returns, by clip (GPU; issue 26).

    PYTHONPATH=. python benchmarks/video_memory.py CLIP.mp4 [CLIP.mp4 ...] [--fps 2] [--model M]

The Qwen2.5-VL-7B tower (random weights, bf16, compiled + CUDA graphs, as `mmenc bench --video`); per clip
its sampled frames and GiB (mmenc.bench.video.peak_beyond_output: measured after warm encodes, so graph
captures are not counted), and the device memory reserved after them (graph pools included). Flat in
the clip's length is the goal: pieces stream. `mmenc bench --video --video-lengths` measures the same on clips it writes.
"""
import argparse

import torch

from mmenc import Encoder
from mmenc.bench.video import peak_beyond_output
from mmenc.preprocess.video_decode import probe
from mmenc.preprocess.video_sampling import VideoOptions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("clips", nargs="+")
    ap.add_argument("--fps", type=float, default=2.0)
    ap.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    args = ap.parse_args()
    enc = Encoder(args.model, load_format="dummy", dtype="bfloat16", compile=True, cuda_graphs=True)
    for clip in args.clips:
        frames = len(enc.video_processor.plan(probe(clip), VideoOptions(fps=args.fps)).indices)
        gib = peak_beyond_output(enc, clip, args.fps)
        print(f"{clip}: {frames} frames, peak beyond the output {gib:.3f} GiB; device memory reserved "
              f"{torch.cuda.memory_reserved(enc.device) / 2 ** 30:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
