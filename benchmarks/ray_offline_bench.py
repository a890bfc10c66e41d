"""Images/s of the offline job (`mmenc encode --ray`) on a local Ray with N encoder actors (one per GPU).

    python benchmarks/ray_offline_bench.py --model Qwen/Qwen2.5-VL-7B-Instruct --dtype bfloat16 \
        --gpus 2 --images 4096 --size 448 --json ray_offline_2gpu.json

1. Writes --images distinct JPEGs (--size px, photo-like) to a corpus folder (reused when present).
2. Starts a local Ray (loopback only) with --gpus GPUs and all CPUs; runs the job into a fresh folder
   with one encoder actor per GPU.
3. Reports images/s over the whole job (actor start, model load and compile included) and in steady
   state (from the shard a quarter of the way through to the last: use --images large enough for
   at least 16 shards), then checks --check images of the output against
   Encoder.encode in this process (relative error, bf16 tolerance 1e-2).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time


def make_corpus(folder: str, images: int, size: int) -> list[str]:
    from serve_load import make_pool  # this script's folder (Python's sys.path[0] for a script)

    os.makedirs(folder, exist_ok=True)
    paths = [os.path.join(folder, f"img{i:06d}.jpg") for i in range(images)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        for first in range(0, images, 256):
            pool = make_pool([(size, size)], min(256, images - first), seed=first)
            for i, data in enumerate(pool):
                with open(paths[first + i], "wb") as f:
                    f.write(data)
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen/Qwen2.5-VL-7B-Instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None, help="cpu to run without GPUs (then --gpus is the actor count)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--gpus", type=int, default=1, help="GPUs given to Ray = encoder actors")
    p.add_argument("--cpus", type=int, default=None, help="CPUs given to Ray (default: all)")
    p.add_argument("--images", type=int, default=4096)
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--shard-size", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=32, help="images per tower call")
    p.add_argument("--corpus", default=None, help="folder of the generated images (default: a temp folder)")
    p.add_argument("--check", type=int, default=16, help="output images compared with Encoder.encode")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    from mmenc.ray.cluster import start_local

    corpus = args.corpus or os.path.join(tempfile.gettempdir(), f"mmenc_ray_corpus_{args.size}")
    t = time.perf_counter()
    paths = make_corpus(corpus, args.images, args.size)
    print(f"corpus: {len(paths)} JPEGs of {args.size}px in {corpus} ({time.perf_counter() - t:.1f} s)", flush=True)
    on_cpu = args.device == "cpu"
    start_local(num_cpus=args.cpus or os.cpu_count(), num_gpus=0 if on_cpu else args.gpus)
    import ray
    import torch

    from mmenc.ray.data import OfflineSettings, read_shards, run_job

    out = tempfile.mkdtemp(prefix="mmenc_ray_out_")
    kwargs = {"model": args.model, "dtype": args.dtype, "compile": args.compile,
              "load_format": "auto" if os.path.isdir(args.model) else "dummy",
              **({"device": "cpu"} if on_cpu else {})}
    settings = OfflineSettings(output=out, shard_size=args.shard_size, encoders=args.gpus, batch_size=args.batch_size,
                               pixel_dtype=args.dtype if args.dtype in ("bfloat16", "float16") else "float32",
                               cpus_per_encoder=1.0)
    marks = []
    report = run_job(paths, kwargs, settings, on_shard=lambda i, r: marks.append((time.perf_counter(), r.images)))
    # steady state: from the shard a quarter of the way through to the last (the first shards arrive in a
    # burst once the actors have started, and the start, model load and compile are not throughput)
    first = marks[len(marks) // 4] if len(marks) >= 4 else None
    steady = (marks[-1][1] - first[1]) / (marks[-1][0] - first[0]) if first and marks[-1][0] > first[0] else float("nan")
    ray.shutdown()

    tensors, failed = read_shards(out)
    ref = __import__("mmenc").Encoder(**kwargs)
    sample = sorted(paths)[:args.check]
    errs = [float((tensors[k] - w.float().cpu()).norm() / w.float().norm()) for k, w in zip(sample, ref.encode(sample))]
    shutil.rmtree(out)
    summary = {"gpus": args.gpus, "images": report.images, "failed": len(failed), "seconds": round(report.seconds, 2),
               "images_per_s_total": round(report.images / report.seconds, 1), "images_per_s_steady": round(steady, 1),
               "max_rel_err_vs_encode": max(errs) if errs else None, "size": args.size, "dtype": args.dtype,
               "model": args.model, "torch": torch.__version__, "ray": ray.__version__,
               "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() and not on_cpu else "cpu",
               "cpus": args.cpus or os.cpu_count()}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0 if not failed and errs and max(errs) < (1e-2 if args.dtype != "float32" else 1e-5) else 1


if __name__ == "__main__":
    sys.exit(main())
