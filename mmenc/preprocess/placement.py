"""Where the Preprocessor's work runs (mmenc.preprocess.pipeline): how many workers, of which kind, and
where images are decoded and resized; chosen once, when a Preprocessor is built.

Workers: default_workers() (the usable cores; 1 beside a CPU tower). worker_kind: "thread" or
"process"; "auto" takes processes on a CUDA device with at least PROCESS_MIN_WORKERS workers, else
threads (choose_worker_kind).

Where the work runs (`resize`, `decode`; "auto" picks):
  resize="cpu": in the workers. resize="device": on `device` with `resize_uint8_exact` (the CPU
    kernel's bytes; float32 would drift); the original uint8 image crosses instead.
    resize="split" (CUDA, "torchvision" backend): the first image per worker of each call on the device
    (they make the call's first tower input, and a 1036 px resize in a worker made that wait: 8 x 1036 px
    encode lead-in 24 ms against 10, run 15e), the rest in the workers, whose CPU is spare while the tower
    runs (a 2000-image mixed-size stream on an H200: 142.3-144.2 images/s resizing in the worker processes,
    140.2-142.5 on the GPU, runs 15c-15e).
    auto: on CUDA with the "torchvision" backend, "split" with worker processes, "device" with threads;
    else "cpu".
  decode="cpu": PIL (`load_image`). decode="torchvision": plain colour JPEGs (paths, bytes) by
    torchvision.io.decode_jpeg on the CPU, without the GIL (PIL's pixels, measured), the rest by PIL.
    decode="gpu": colour JPEGs are decoded by nvJPEG on `device` (needs torchvision; implies
    resize="device"); other inputs, and any JPEG nvJPEG refuses, are decoded on the CPU.
    auto: "torchvision" when it imports, else "cpu"; never "gpu", because nvJPEG's pixels are not
    libjpeg-turbo's (up to 15 levels; docs/preprocessing.md).
"""
import os
from typing import Any

import torch

from mmenc.preprocess import gpu_decode

# worker_kind="auto" picks processes on a CUDA device from this many workers: there the calling thread
# launches the tower and shares the GIL with worker threads (H200, runs 14b/14c: 32 x 448 px encode at
# 90% of the tower alone with 8 or 16 worker processes, 81% with as many threads; docs/preprocessing.md).
PROCESS_MIN_WORKERS = 8


def default_workers(tower_device: torch.device | str | None = None) -> int:
    """Workers for decode+resize: the cores this process may run on; 1 when the tower itself runs on this
    CPU (`tower_device` "cpu"): its intra-op threads already use every core, and a CPU tower takes
    seconds per image against milliseconds to decode and resize one, so one worker keeps ahead of it
    while more would only take cores from the tower (each worker's torch ops start intra-op threads
    of their own: 2 workers beside a 2-thread tower made 6 busy threads on 2 cores)."""
    if tower_device is not None and torch.device(tower_device).type == "cpu":
        return 1
    return usable_cores()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask: taskset, cgroups' cpusets)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def choose_decode(decode: str, device: torch.device) -> str:
    """The Preprocessor's `decode` for what was asked (ValueError naming why a choice cannot run)."""
    if decode not in ("auto", "cpu", "torchvision", "gpu"):
        raise ValueError(f"decode={decode!r}; expected 'auto', 'cpu', 'torchvision' or 'gpu'")
    if decode == "gpu" and (reason := gpu_decode.unavailable_reason(device)):
        raise ValueError(f"decode='gpu' cannot run: {reason}; use decode='cpu'")
    if decode == "torchvision" and (reason := gpu_decode.cpu_decoder_reason()):
        raise ValueError(f"decode='torchvision' cannot run: {reason}; use decode='cpu' (PIL)")
    if decode == "auto":
        return "cpu" if gpu_decode.cpu_decoder_reason() else "torchvision"
    return decode


def choose_worker_kind(kind: str, workers: int, device: torch.device) -> str:
    """The Preprocessor's `worker_kind` for what was asked, its `workers` and device."""
    if kind not in ("auto", "thread", "process"):
        raise ValueError(f"worker_kind={kind!r}; expected 'auto', 'thread' or 'process'")
    if kind == "process" and workers == 0:
        raise ValueError("worker_kind='process' with workers=0 (everything in the calling thread); "
                         "pass workers >= 1, or worker_kind='thread'")
    if kind == "auto":
        return "process" if device.type == "cuda" and workers >= PROCESS_MIN_WORKERS else "thread"
    return kind


def choose_resize(resize: str, processor: Any, decode: str, worker_kind: str, device: torch.device) -> str:
    """The Preprocessor's `resize` for what was asked, given its processor (its config's `backend`), the
    decode and worker kind chosen, and its device."""
    if resize not in ("auto", "cpu", "device", "split"):
        raise ValueError(f"resize={resize!r}; expected 'auto', 'cpu', 'device' or 'split'")
    backend = getattr(getattr(processor, "config", None), "backend", "torchvision")
    if decode == "gpu":
        return "device"
    if resize == "auto" and device.type == "cuda" and backend == "torchvision":
        return "split" if worker_kind == "process" else "device"
    if resize == "split" and (device.type == "cpu" or backend != "torchvision"):
        raise ValueError(f"resize='split' needs a GPU device and the 'torchvision' backend (device "
                         f"{device.type}, backend {backend!r}); use 'cpu'")
    return "cpu" if resize == "auto" else resize
