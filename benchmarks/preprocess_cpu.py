"""CPU preprocessing micro-benchmark: mmenc's sequential processor vs its parallel Preprocessor
(1, 2, ... workers) vs transformers' default image processor, on the same generated JPEG bytes.

    PYTHONPATH=. python benchmarks/preprocess_cpu.py [--reps 5] [--workers 1 2] [--model qwen2_5_vl]

"pipeline w=n" uses n cores in all (n worker threads, torch.set_num_threads(n)); the others run
with torch's default threads. Every column is end to end from JPEG bytes to pixel_values on the CPU (decode included; for
transformers the decode is PIL's `Image.open(...).convert("RGB")` before its processor, as its
`load_image` does). transformers' default processor is the torchvision class when torchvision is
importable, else the Pil class (the column header says which). Median of --reps runs after one
warm-up. Images are smooth random pictures (bicubic-upscaled noise plus grain) saved at quality 90.
"""
import argparse
import importlib
import importlib.util
import io
import os
import statistics
import threading
import time

import numpy as np
import torch
from PIL import Image

from mmenc.preprocess import get_processor
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.placement import default_workers

WORKLOADS = {  # name: (count, height, width); the first two are the issue's, the third needs a resize
    "8x1036px": (8, 1036, 1036),
    "32x448px": (32, 448, 448),
    "8x1600x1200 (resized)": (8, 1200, 1600),
}
HF_CLASSES = {"qwen2_vl": ("qwen2_vl", "Qwen2VLImageProcessor"), "qwen2_5_vl": ("qwen2_vl", "Qwen2VLImageProcessor"),
              "kimi_k25": ("kimi_k25", "Kimi_K25ImageProcessor")}


def make_jpegs(count: int, height: int, width: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        coarse = rng.integers(0, 256, (height // 32 + 2, width // 32 + 2, 3), dtype=np.uint8)
        a = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC)).astype(np.int16)
        a = np.clip(a + rng.integers(-8, 9, a.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(a).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def hf_processor(model: str):
    """transformers' default image processor for `model`, built from its defaults (nothing downloaded)."""
    module, cls = HF_CLASSES[model]
    mod = importlib.import_module(f"transformers.models.{module}")
    if importlib.util.find_spec("torchvision") is None and hasattr(mod, cls + "Pil"):
        cls += "Pil"
    return getattr(mod, cls)(), cls


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def thread_split(proc, datas: list[bytes], workers: int, reps: int) -> tuple[float, float]:
    """CPU ms spent in the worker threads and in the calling thread by one pipeline run (least of
    `reps`), with one torch thread: how much of the work can spread over cores, whatever the load."""
    with Preprocessor(proc, workers=workers) as pre:
        best = (float("inf"), 0.0)
        for _ in range(reps):
            with pre.step_spans() as spans:
                t0 = time.thread_time()
                pre.run(datas)
                calling = time.thread_time() - t0  # all of the calling thread's CPU time
            here = threading.current_thread().name
            in_workers = sum(s.cpu_s for s in spans if s.step == "prepare" and s.thread != here)
            if in_workers + calling < sum(best):
                best = (in_workers, calling)
    return best[0] * 1e3, best[1] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, default_workers()}))
    ap.add_argument("--model", default="qwen2_5_vl", choices=sorted(HF_CLASSES))
    args = ap.parse_args()

    proc = get_processor(args.model)
    hf, hf_name = hf_processor(args.model)
    print(f"# cores usable: {default_workers()} (os.cpu_count()={os.cpu_count()}), load average "
          f"{os.getloadavg()[0]:.1f}, torch threads: {torch.get_num_threads()} (pipeline w=n: n), "
          f"torch {torch.__version__}; transformers class: {hf_name}")
    cols = ["sequential"] + [f"pipeline w={w}" for w in args.workers] + [f"transformers ({hf_name})"]
    scale = f" | w={args.workers[-1]} vs w={args.workers[0]}" if len(args.workers) > 1 else ""
    print("| workload | " + " | ".join(f"{c} ms" for c in cols) + " | best pipeline vs sequential" + scale + " |")
    print("|---" * (len(cols) + 2 + bool(scale)) + "|")
    splits = []
    for name, (count, h, w) in WORKLOADS.items():
        datas = make_jpegs(count, h, w)
        row = {"sequential": median_ms(lambda: proc(datas), args.reps)}
        threads = torch.get_num_threads()
        for n in args.workers:  # n cores in all: n worker threads and n torch intra-op threads
            torch.set_num_threads(n)
            with Preprocessor(proc, workers=n) as pre:
                row[f"pipeline w={n}"] = median_ms(lambda: pre.run(datas), args.reps)
        torch.set_num_threads(threads)

        def hf_run():
            ims = [Image.open(io.BytesIO(d)).convert("RGB") for d in datas]
            return hf(images=ims, return_tensors="pt")

        row[f"transformers ({hf_name})"] = median_ms(hf_run, args.reps)
        best = min(row[f"pipeline w={n}"] for n in args.workers)
        ratio = (f" | {row[f'pipeline w={args.workers[0]}'] / row[f'pipeline w={args.workers[-1]}']:.2f}x"
                 if scale else "")
        print(f"| {name} | " + " | ".join(f"{row[c]:.1f}" for c in cols) + f" | {row['sequential'] / best:.2f}x{ratio} |")
        torch.set_num_threads(1)
        splits.append((name, *thread_split(proc, datas, max(args.workers), args.reps)))
        torch.set_num_threads(threads)
    print(f"\n| workload (w={max(args.workers)}, 1 torch thread) | CPU ms in workers | CPU ms in calling thread | "
          f"parallel fraction | Amdahl bound on {max(args.workers)} cores |")
    print("|---|---|---|---|---|")
    for name, in_workers, calling in splits:
        frac = in_workers / (in_workers + calling)
        bound = 1 / ((1 - frac) + frac / max(args.workers))
        print(f"| {name} | {in_workers:.0f} | {calling:.0f} | {frac:.2f} | {bound:.2f}x |")


if __name__ == "__main__":
    main()
