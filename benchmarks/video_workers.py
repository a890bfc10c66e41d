"""One video's preprocessing for a CUDA device in the worker processes alone (no GPU needed): probe,
plan, pieces in decode lanes, each piece decoded + resized in a worker, its uint8 frames back in
shared memory and copied out by the calling thread as the pinned copy would (issue 26).

    PYTHONPATH=. python benchmarks/video_workers.py CLIP.mp4 [--workers 1 2 4 8 16] [--reps 2] [--fps 2]

Per worker count: wall ms for the clip's sampled frames (median of --reps after a warm-up that starts
the processes), frames/s, frames/s per worker, pieces and lanes, the calling thread's copy ms. The
family is Qwen2.5-VL's video processor (560x1008 for 720p at 2 fps: the `mmenc bench --video` clip)."""
import argparse
import statistics
import time
import uuid

from mmenc.preprocess import get_processor
from mmenc.preprocess.prepare import ImageWork
from mmenc.preprocess.procs import ProcessWorkers
from mmenc.preprocess.video_decode import probe
from mmenc.preprocess.video_families import get_video_processor
from mmenc.preprocess.video_sampling import VideoOptions


def one_pass(workers: ProcessWorkers, vp, clip: str, fps: float, lanes: int) -> tuple[float, float, int, int, int]:
    start = time.perf_counter()
    plan = vp.plan(probe(clip), VideoOptions(fps=fps))
    pieces = vp.pieces(clip, clip, plan, 16384, 4096, video_id=uuid.uuid4().hex, lanes=lanes)
    futures = [workers.submit(0, p) for p in pieces]
    copy_s = 0.0
    for f in futures:
        ready = f.result(timeout=600)
        t = time.perf_counter()
        ready.pixels.clone()
        copy_s += time.perf_counter() - t
        ready.release()
    return time.perf_counter() - start, copy_s, len(plan.indices), len(pieces), len({p.lane for p in pieces})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("clip")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--fps", type=float, default=2.0)
    args = ap.parse_args()
    vp = get_video_processor("qwen2_5_vl")
    work = ImageWork(get_processor("qwen2_5_vl"), "cpu", "cpu", "cuda", -1, vp)  # a CUDA device's worker side
    for n in args.workers:
        workers = ProcessWorkers(work, n)
        try:
            one_pass(workers, vp, args.clip, args.fps, n)  # starts the processes
            runs = [one_pass(workers, vp, args.clip, args.fps, n) for _ in range(args.reps)]
        finally:
            workers.close()
        wall = statistics.median(r[0] for r in runs)
        _, copy_s, frames, pieces, lanes = runs[-1]
        print(f"workers={n}: {wall * 1e3:.0f} ms for {frames} frames ({frames / wall:.1f} frames/s, "
              f"{frames / wall / n:.1f} per worker), {pieces} pieces in {lanes} lanes, calling thread's copies "
              f"{copy_s * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
