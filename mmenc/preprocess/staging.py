"""Host-side staging of uint8 images for the device: pinned copies without transposes, one
non-blocking copy per image (mmenc.preprocess.pipeline's workers and calling thread).

Copies on the host are numpy's, not torch's: torch's intra-op threads (one per core) running beside
busy worker threads made a host torch.cat of 8 x 1036 px images take 86 ms on a 32-core H200 host
(benchmarks/e2e_profile.py; docs/preprocessing.md).
"""
from collections.abc import Callable

import numpy as np
import torch


def chw(array: np.ndarray) -> torch.Tensor:
    """RGB uint8 [H, W, C] (read-only from PIL is fine) -> a new contiguous uint8 tensor [C, H, W]."""
    return torch.from_numpy(array.transpose(2, 0, 1).copy())  # a copy: writable, C order


def memory_order(t: torch.Tensor) -> list[int]:
    """t's dimensions from the largest stride to the smallest: t.permute(order) walks its memory in order."""
    return sorted(range(t.dim()), key=lambda d: -t.stride(d))


def layout_copy(pixels: torch.Tensor | np.ndarray, alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
                ) -> torch.Tensor:
    """An image ([C, H, W] tensor, maybe a view of [H, W, C] memory; a numpy [H, W, C] array; any
    tensor) -> its values in new memory from `alloc(shape, dtype)` (a contiguous tensor), laid out as
    the source's (no transpose), returned in the source's dimension order ([C, H, W] for an array).
    Copied by numpy: torch's intra-op threads (one per core) must not run beside the worker threads
    (a host torch.cat of 8 x 1036 px took 86 ms with 32 of them, benchmarks/e2e_profile.py)."""
    if isinstance(pixels, np.ndarray):
        src, back = pixels, (2, 0, 1)  # [H, W, C] -> [C, H, W]
    else:
        order = memory_order(pixels)
        dense = pixels.permute(order)
        if not dense.is_contiguous():  # not a permutation of dense memory: make it contiguous
            order, dense = list(range(pixels.dim())), pixels.contiguous()
        src, back = dense.numpy(), tuple(order.index(d) for d in range(pixels.dim()))
    out = alloc(tuple(src.shape), torch.from_numpy(np.empty(0, src.dtype)).dtype)
    np.copyto(out.numpy(), src)
    return out.permute(back)


def pinned_copy(pixels: torch.Tensor | np.ndarray) -> torch.Tensor:
    """A uint8 image ([C, H, W] tensor, maybe a view of [H, W, C] memory; or a numpy [H, W, C] array)
    -> its values in new pinned host memory laid out as the source's (no transpose), as [C, H, W]
    (`layout_copy`)."""
    pin = torch.cuda.is_available()
    return layout_copy(pixels, lambda shape, dtype: torch.empty(shape, dtype=dtype, pin_memory=pin))


def to_device_each(images: list[torch.Tensor | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """CPU uint8 images ([C, H, W] tensors, or numpy [H, W, C] arrays on CUDA) -> [C, H, W] on `device`,
    each in its own memory layout (a view of [H, W, C] memory stays one), by one non-blocking copy per
    image from pinned memory on CUDA (the host never waits for the device here). What is not pinned
    yet is copied into pinned memory first (`pinned_copy`). Call it from the thread that runs the
    tower: pinned allocations are CUDA calls, which another thread's CUDA graph capture forbids."""
    if device.type == "cpu" or not images:
        return images
    out = []
    for t in images:
        if device.type == "cuda" and (isinstance(t, np.ndarray) or not t.is_pinned()):
            t = pinned_copy(t)
        elif isinstance(t, np.ndarray):
            t = chw(t)
        order = memory_order(t)
        dense = t.permute(order)
        if not dense.is_contiguous():
            order, dense = list(range(t.dim())), t.contiguous()
        out.append(dense.to(device, non_blocking=True).permute([order.index(d) for d in range(t.dim())]))
    return out
