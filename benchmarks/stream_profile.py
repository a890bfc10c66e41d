"""Where the thread that drives an `Encoder.encode_iter` stream spends its time (issue 11: the stream is
host-bound when that thread's work per tower call exceeds the call's GPU time).

    PYTHONPATH=. python benchmarks/stream_profile.py [--images 300] [--top 35] [--eager]

The Qwen2.5-VL-7B tower (random weights, bf16, compile + CUDA graphs unless --eager) on the CUDA
device; the stream of `mmenc bench --e2e` (64 mixed-size JPEG files, 259-1036 px a side, cycled),
one warm-up pass over the files, then `--images` images through encode_iter under cProfile (the
calling thread only: the worker processes and the receiver thread are not in it). Prints the
stream's images/s and the Encoder's tally (host seconds per part), then the functions with the most
own time and the most cumulative time. cProfile slows Python-heavy code: read it for shares, not rates.
"""
import argparse
import cProfile
import io
import itertools
import pathlib
import pstats
import sys
import tempfile
import time

import numpy as np
import torch

from mmenc.bench.e2e import write_jpegs
from mmenc.engine.encoder import Encoder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--images", type=int, default=300)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--eager", action="store_true", help="no torch.compile, no CUDA graphs")
    p.add_argument("--no-profile", action="store_true", help="time the stream and print the tally only")
    p.add_argument("--no-side-stream", action="store_true",
                   help="stage chunks on the current stream (Preprocessor.stage_beside = False)")
    p.add_argument("--resize", choices=["auto", "cpu", "device"], default="auto",
                   help="Encoder(preprocess_resize=...): where images are resized (default: %(default)s)")
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval(S) for the stream (Python's default: 0.005)")
    args = p.parse_args()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if not torch.cuda.is_available():
        print("stream_profile.py needs a CUDA device", file=sys.stderr)
        return 2
    enc = Encoder("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy", dtype="bfloat16", device="cuda",
                  compile=not args.eager, cuda_graphs=not args.eager, preprocess_resize=args.resize)
    enc.preprocessor.stage_beside = not args.no_side_stream
    rng = np.random.default_rng(7)
    sizes = [tuple(int(x) for x in rng.integers(259, 1037, 2)) for _ in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        pool = write_jpegs(pathlib.Path(tmp), sizes, seed=99)
        for _ in enc.encode_iter(pool):  # compile, kernels, page cache
            pass
        torch.cuda.synchronize()
        before = enc.tally.snapshot(), enc.preprocessor.tally.snapshot()
        profile = cProfile.Profile()
        begin = time.perf_counter()
        if not args.no_profile:
            profile.enable()
        for _ in enc.encode_iter(itertools.islice(itertools.cycle(pool), args.images)):
            pass
        torch.cuda.synchronize()
        profile.disable()
        wall = time.perf_counter() - begin
    print(f"stream{'' if args.no_profile else ' under cProfile'} (side stream {not args.no_side_stream}, "
          f"resize {enc.preprocessor.resize}): "
          f"{args.images} images in {wall:.2f} s = {args.images / wall:.1f} img/s")
    for tally, since in zip((enc.tally, enc.preprocessor.tally), before):
        print("tally:", {k: round(v, 3) for k, v in tally.since(since).items()})
    for key in () if args.no_profile else ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(key).print_stats(args.top)
        print(f"== by {key}\n" + "\n".join(out.getvalue().splitlines()[6:]))
    enc.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
