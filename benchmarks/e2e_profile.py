"""Where `Encoder.encode(files)` spends its preprocessing time: each stage of `Preprocessor.run` timed
alone, on the Qwen2.5-VL processor (no tower, no transformers), for the two e2e workloads.

    PYTHONPATH=. python benchmarks/e2e_profile.py [--device cuda|cpu] [--reps 7] [--json out.json]

Per workload (JPEG files written by mmenc.bench.e2e helpers, quality 90, page cache warm), median
ms of --reps runs after one warm-up, the device synchronised after each run:
  read          Path.read_bytes of every file
  pil decode    Image.open(bytes).convert("RGB") -> numpy; load_image(path) as a whole (+ checks,
                EXIF, the read); both in 1 thread and in a thread pool of w threads
  chw copy      numpy HWC -> contiguous CHW uint8 tensor (`_chw`)
  pinned alloc  a pinned buffer of the chunk's bytes (the former staging allocated one per chunk)
  to_device     `to_device_each` (pin each image + H2D each); a cat into a reused pinned buffer,
                and HWC into pinned (plain memcpy) + permute on the device instead
  resize        processor.resize_one on the device per image (skipped when the size is unchanged)
  finish        processor.finish (patchify + normalize) on the device
  run w=n       Preprocessor.run(paths) with n workers (torch threads left as they are, and =1)
  alternatives  torchvision.io.decode_jpeg on the CPU (1 thread, pool), nvJPEG batch decode on the
                GPU, each with its max |diff| against PIL's pixels (uint8 levels); Preprocessor
                with decode="gpu" and resize="cpu"
Then a cProfile of one Preprocessor.run in the calling thread (what it waits on), and the table.
"""
import argparse
import cProfile
import io
import json
import os
import pathlib
import pstats
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from PIL import Image

from mmenc.bench.e2e import image_sizes, write_jpegs
from mmenc.bench.measure import WORKLOADS
from mmenc.preprocess.images import load_image
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.placement import default_workers
from mmenc.preprocess.staging import chw as _chw
from mmenc.preprocess.staging import to_device_each as _to_device
from mmenc.preprocess.qwen_vl import qwen2_vl_from_hf

NAMES = ("8x1036px", "32x448px")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, reps: int, warmup: int = 1) -> float:
    """Median wall ms of fn() over reps runs after warmup runs, device synchronised."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def pil_decode(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def in_pool(pool: ThreadPoolExecutor, fn, items) -> list:
    return list(pool.map(fn, items))


def level_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.cpu().int() - b.cpu().int()).abs().max())


class Profile:
    def __init__(self, device: torch.device, reps: int, workers: list[int]):
        self.device, self.reps, self.workers = device, reps, workers
        self.rows: list[dict] = []
        self.notes: list[str] = []
        self.tv = _torchvision()

    def add(self, workload: str, stage: str, fn, note: str = "") -> float | None:
        try:
            ms = timed(fn, self.device, self.reps)
        except (RuntimeError, ValueError, OSError, TypeError) as e:  # a stage that cannot run here is reported
            self.rows.append({"workload": workload, "stage": stage, "ms": None, "note": f"FAILED: {e}"[:160]})
            print(f"  {stage:<44} FAILED: {e}", file=sys.stderr, flush=True)
            return None
        self.rows.append({"workload": workload, "stage": stage, "ms": ms, "note": note})
        print(f"  {stage:<44} {ms:9.2f} ms  {note}", file=sys.stderr, flush=True)
        return ms

    def workload(self, name: str, paths: list[str], processor) -> None:
        dev, cuda = self.device, self.device.type == "cuda"
        print(f"{name}: {len(paths)} files", file=sys.stderr, flush=True)
        datas = [pathlib.Path(p).read_bytes() for p in paths]
        arrays = [pil_decode(d) for d in datas]
        plans = [processor.plan(a.shape[0], a.shape[1], index=i) for i, a in enumerate(arrays)]
        self.notes.append(f"{name}: input {arrays[0].shape[0]}x{arrays[0].shape[1]} -> resize {plans[0].resize}, "
                          f"grid {plans[0].grid}, {sum(p.rows for p in plans)} rows; "
                          f"{sum(len(d) for d in datas) / 1e6:.2f} MB JPEG, "
                          f"{sum(a.nbytes for a in arrays) / 1e6:.1f} MB RGB")
        add = lambda stage, fn, note="": self.add(name, stage, fn, note)  # noqa: E731
        add("read files", lambda: [pathlib.Path(p).read_bytes() for p in paths])
        add("pil decode, 1 thread", lambda: [pil_decode(d) for d in datas])
        add("load_image(path), 1 thread", lambda: [load_image(p, index=i) for i, p in enumerate(paths)])
        for w in self.workers:
            with ThreadPoolExecutor(w) as pool:
                add(f"pil decode, pool {w}", lambda: in_pool(pool, pil_decode, datas))
                add(f"load_image(path), pool {w}", lambda: in_pool(pool, load_image, paths))
        add("np HWC -> CHW copy (_chw), 1 thread", lambda: [_chw(a) for a in arrays])
        with ThreadPoolExecutor(max(self.workers)) as pool:
            add(f"np HWC -> CHW copy, pool {max(self.workers)}", lambda: in_pool(pool, _chw, arrays))
        chws = [_chw(a) for a in arrays]
        total = sum(t.numel() for t in chws)
        add("torch.cat of the CHW images (not pinned)", lambda: torch.cat([t.reshape(-1) for t in chws]))
        if cuda:
            add("pinned alloc of the chunk's bytes", lambda: torch.empty(total, dtype=torch.uint8, pin_memory=True))
            add("_to_device (pin each image + H2D each)", lambda: _to_device(chws, dev))
            pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            add("cat into reused pinned + H2D", lambda: torch.cat([t.reshape(-1) for t in chws], out=pinned)
                .to(dev, non_blocking=True))
            add("H2D only from pinned", lambda: pinned.to(dev, non_blocking=True))
            add("HWC memcpy into reused pinned + H2D + permute on device",
                lambda: _hwc_pinned_to_device(arrays, pinned, dev))
            add("H2D pageable (CHW tensors one by one)", lambda: [t.to(dev) for t in chws])
        on_dev = _to_device(chws, dev)
        sync(dev)
        add("resize_one on device, all images", lambda: [processor.resize_one(t, p) for t, p in zip(on_dev, plans)],
            note=f"{arrays[0].shape[:2]} -> {plans[0].resize}")
        resized = [processor.resize_one(t, p) for t, p in zip(on_dev, plans)]
        add("processor.finish (patchify + normalize)", lambda: processor.finish(resized, plans))
        threads = torch.get_num_threads()
        for w in self.workers:
            with Preprocessor(processor, device=dev, workers=w) as pre:
                add(f"Preprocessor.run w={w} (torch threads {threads})", lambda: pre.run(paths))
        for tthreads in sorted({1, 4, threads}):
            torch.set_num_threads(tthreads)
            try:
                with Preprocessor(processor, device=dev) as pre:
                    add(f"Preprocessor.run w={pre.workers} torch threads {tthreads}", lambda: pre.run(paths))
            finally:
                torch.set_num_threads(threads)
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.0005)
        try:
            with Preprocessor(processor, device=dev) as pre:
                add(f"Preprocessor.run w={pre.workers} switchinterval 0.5 ms", lambda: pre.run(paths))
                with ThreadPoolExecutor(pre.workers) as pool:
                    add(f"pil decode, pool {pre.workers}, switchinterval 0.5 ms",
                        lambda: in_pool(pool, pil_decode, datas))
        finally:
            sys.setswitchinterval(old)
        self._instrumented(name, paths, processor)
        if cuda:
            self._host_blocking(name, paths, processor, chws, plans)
        if cuda:
            with Preprocessor(processor, device=dev, resize="cpu") as pre:
                add(f"Preprocessor.run w={pre.workers} resize=cpu", lambda: pre.run(paths))
        try:  # an alternative that cannot run here (torchvision build, nvJPEG) is a note, not the end
            self._alternatives(name, paths, datas, arrays, processor)
        except (RuntimeError, ValueError, TypeError, AttributeError, ImportError, OSError) as e:
            self.notes.append(f"{name}: alternatives stopped: {type(e).__name__}: {e}")
        self._cprofile(name, paths, processor)

    def _alternatives(self, name, paths, datas, arrays, processor) -> None:
        dev, cuda = self.device, self.device.type == "cuda"
        if self.tv is None:
            self.notes.append(f"{name}: torchvision not importable: decode_jpeg / nvJPEG rows skipped")
            return
        from torchvision.io import ImageReadMode, decode_jpeg

        encoded = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in datas]
        pil_chw = [_chw(a) for a in arrays]
        tv_cpu = [decode_jpeg(e, mode=ImageReadMode.RGB) for e in encoded]
        diff = max(level_diff(a, b) for a, b in zip(tv_cpu, pil_chw))
        self.add(name, "torchvision decode_jpeg CPU, 1 thread",
                 lambda: [decode_jpeg(e, mode=ImageReadMode.RGB) for e in encoded], note=f"max |diff| vs PIL {diff}")
        w = max(self.workers)
        with ThreadPoolExecutor(w) as pool:
            self.add(name, f"torchvision decode_jpeg CPU, pool {w}",
                     lambda: in_pool(pool, lambda e: decode_jpeg(e, mode=ImageReadMode.RGB), encoded))
        self.add(name, "torchvision read_file+decode_jpeg CPU, pool",
                 lambda: _tv_read_decode_pool(paths, w, ImageReadMode.RGB))
        if not cuda:
            return
        try:
            gpu = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=dev)
        except RuntimeError as e:
            self.notes.append(f"{name}: nvJPEG failed: {e}")
            return
        diff = max(level_diff(a, b) for a, b in zip(gpu, pil_chw))
        self.add(name, "nvJPEG batch decode (GPU)", lambda: decode_jpeg(encoded, mode=ImageReadMode.RGB, device=dev),
                 note=f"max |diff| vs PIL {diff}")
        with Preprocessor(processor, device=dev, decode="gpu") as pre:
            with Preprocessor(processor, device=dev, decode="cpu") as cpu_pre:
                ref = cpu_pre.run(paths).pixel_values
            got = pre.run(paths).pixel_values
            std = min(processor.config.image_std)
            levels = float((got - ref).abs().max()) * std * 255
            self.add(name, f"Preprocessor.run w={pre.workers} decode=gpu", lambda: pre.run(paths),
                     note=f"pixels vs decode=cpu: {levels:.2f} uint8 levels")

    def _host_blocking(self, name, paths, processor, chws, plans) -> None:
        """Does a step make the host wait for the device? Queue ~50 ms of GPU work (torch.cuda._sleep),
        then time the step on the host without synchronising: ~50 ms or more means it waited (a
        pageable copy, .item(), ...), which in encode/encode_iter stalls the next chunk behind the tower."""
        dev = self.device
        on_dev = _to_device(chws, dev)
        resized = [processor.resize_one(t, p) for t, p in zip(on_dev, plans)]
        sync(dev)
        cycles = _sleep_cycles(dev, 50.0)
        steps = {"torch.tensor(3 floats, device=cuda)": lambda: torch.tensor([0.5, 0.5, 0.5], device=dev),
                 "_to_device": lambda: _to_device(chws, dev),
                 "resize_one, all images": lambda: [processor.resize_one(t, p) for t, p in zip(on_dev, plans)],
                 "processor.finish": lambda: processor.finish(resized, plans)}
        with Preprocessor(processor, device=dev) as pre:
            pre.run(paths)
            steps["Preprocessor.run"] = lambda: pre.run(paths)
            for label, fn in steps.items():
                fn()
                busy, idle = [], []
                for _ in range(3):
                    for sleep, into in ((cycles, busy), (0, idle)):
                        sync(dev)
                        if sleep:
                            torch.cuda._sleep(sleep)
                        t0 = time.perf_counter()
                        fn()
                        into.append((time.perf_counter() - t0) * 1e3)
                        sync(dev)
                ms, base = statistics.median(busy), statistics.median(idle)
                self.rows.append({"workload": name, "stage": f"host ms, GPU busy 50 ms: {label}", "ms": ms,
                                  "note": f"idle GPU {base:.2f} ms: " + ("WAITS for the GPU" if ms - base > 30
                                                                         else "does not wait")})

    def _instrumented(self, name, paths, processor) -> None:
        """One Preprocessor.run with its per-image prepare (worker threads) and each chunk's stage (calling
        thread, device synced) timed (Preprocessor.step_spans): where its wall time goes."""
        dev = self.device
        with Preprocessor(processor, device=dev) as pre:
            for _ in range(2):  # the second run is the one reported
                with pre.step_spans(sync=True) as steps:
                    sync(dev)
                    t0 = time.perf_counter()
                    pre.run(paths)
                    sync(dev)
                    wall = (time.perf_counter() - t0) * 1e3
        prepares = [s for s in steps if s.step == "prepare"]
        prep = [(s.end - s.start) * 1e3 for s in prepares]
        first, last = min(s.start for s in prepares), max(s.end for s in prepares)
        stage_ms = sum((s.end - s.start) * 1e3 for s in steps if s.step == "stage")
        self.notes.append(
            f"{name}: one Preprocessor.run (w={pre.workers}) timed inside: wall {wall:.1f} ms; per-image prepare "
            f"(decode+plan+chw, worker threads) median {statistics.median(prep):.1f} ms, max {max(prep):.1f}, "
            f"sum {sum(prep):.1f}; first prepare start +{(first - t0) * 1e3:.1f} ms, last prepare end "
            f"+{(last - t0) * 1e3:.1f} ms; stage (pinned staging, resize, finish; calling thread, synced) "
            f"{stage_ms:.1f} ms")

    def _cprofile(self, name, paths, processor) -> None:
        with Preprocessor(processor, device=self.device) as pre:
            pre.run(paths)
            sync(self.device)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                pre.run(paths)
            sync(self.device)
            prof.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(12)
            body = out.getvalue()
            self.notes.append(f"{name}: cProfile of 3 x Preprocessor.run (calling thread, by {key}):\n"
                              + body[body.find("ncalls"):].rstrip())


def _hwc_pinned_to_device(arrays, pinned: torch.Tensor, dev: torch.device) -> list[torch.Tensor]:
    offset, views = 0, []
    for a in arrays:
        n = a.size
        np.copyto(pinned[offset:offset + n].numpy().reshape(a.shape), a)
        views.append((offset, a.shape))
        offset += n
    flat = pinned[:offset].to(dev, non_blocking=True)
    return [flat[o:o + int(np.prod(s))].view(*s).permute(2, 0, 1).contiguous() for o, s in views]


def _sleep_cycles(dev: torch.device, ms: float) -> int:
    """Cycles of torch.cuda._sleep that keep the GPU busy about `ms` milliseconds (measured)."""
    probe = 10_000_000
    sync(dev)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    sync(dev)
    return int(probe * ms / max(start.elapsed_time(end), 1e-3))


def _tv_read_decode_pool(paths, w, mode):
    from torchvision.io import decode_jpeg, read_file

    with ThreadPoolExecutor(w) as pool:
        return list(pool.map(lambda p: decode_jpeg(read_file(p), mode=mode), paths))


def _torchvision():
    try:
        import torchvision

        return torchvision.__version__
    except ImportError:
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--workers", type=int, nargs="+", default=None,
                    help="pool sizes (default: 1 4 8 16 32 capped at twice the usable cores)")
    ap.add_argument("--workload", choices=NAMES, action="append", default=None)
    ap.add_argument("--json", type=pathlib.Path, default=None)
    args = ap.parse_args()
    device = torch.device(args.device)
    cores = default_workers()
    workers = args.workers or [w for w in (1, 4, 8, 16, 32) if w <= max(2 * cores, 4)]
    t0 = time.perf_counter()
    prof = Profile(device, args.reps, workers)
    import PIL.features

    header = (f"device={device} torch={torch.__version__} torchvision={prof.tv} PIL={Image.__version__} "
              f"libjpeg_turbo={PIL.features.check_feature('libjpeg_turbo')} cores={cores} "
              f"cpu_count={os.cpu_count()} torch_threads={torch.get_num_threads()} python={sys.version.split()[0]}"
              + (f" gpu={torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    print(header, file=sys.stderr, flush=True)
    processor = qwen2_vl_from_hf(None)
    with tempfile.TemporaryDirectory(prefix="mmenc-e2e-profile-") as tmp:
        for i, name in enumerate(args.workload or NAMES):
            paths = write_jpegs(pathlib.Path(tmp) / name, image_sizes(WORKLOADS[name], 14), seed=i)
            prof.workload(name, paths, processor)
    print(header)
    for note in prof.notes:
        print(note)
    print()
    head = f"{'workload':<10} {'stage':<52} {'ms':>9}  note"
    print(head)
    print("-" * len(head))
    for r in prof.rows:
        ms = f"{r['ms']:9.2f}" if r["ms"] is not None else f"{'-':>9}"
        print(f"{r['workload']:<10} {r['stage']:<52} {ms}  {r['note']}")
    print(f"total profile time {time.perf_counter() - t0:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({"header": header, "notes": prof.notes, "rows": prof.rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
