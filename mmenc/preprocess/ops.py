"""Resize and normalize exactly as transformers' two image-processor backends do.

backend="torchvision" (transformers' default whenever torchvision is importable; the only backend
of its video processors and of Kimi-K2.5): bicubic with antialias through
`torch.nn.functional.interpolate`. On CPU, uint8 images are resized natively in uint8 (what
torchvision >= 0.27 does for BICUBIC on CPU); on other devices in float32, then clamped, rounded and
cast back (torchvision's path there). Rescale+normalize fused: (x - mean/r) / (std/r) in float32.
torchvision itself is not needed.

backend="pil" (transformers' `...ImageProcessorPil`, the fallback without torchvision): PIL bicubic
on uint8, then float64 rescale cast to float32, then (x - mean) / std in float32.

Both give bitwise the transformers output of the same backend. They differ from each other after a
resize (different fixed-point pipelines): up to ~20 uint8 levels on random noise, ~0.3 after CLIP
normalization; unresized images agree to ~1e-6.
"""
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from mmenc.utils.device_copy import to_device  # pinned, asynchronous: no host wait behind queued kernels

BACKENDS = ("torchvision", "pil")


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} not supported; expected one of {BACKENDS}")
    return backend


_PIL_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR,
                 "lanczos": Image.Resampling.LANCZOS}  # lanczos: backend "pil" only (Idefics3 / SmolVLM)


def resize_uint8(images: torch.Tensor, height: int, width: int, backend: str, resample: str = "bicubic") -> torch.Tensor:
    """Bicubic (or resample="bilinear", antialiased likewise) resize.
    images uint8 [B, C, H, W] -> uint8 [B, C, height, width]."""
    if resample not in _PIL_RESAMPLE:
        raise ValueError(f"resample={resample!r} not supported; expected one of {tuple(_PIL_RESAMPLE)}")
    if tuple(images.shape[-2:]) == (height, width):
        return images
    if resample == "lanczos" and backend != "pil":
        raise ValueError("resample='lanczos' needs backend='pil' (torch has no Lanczos resize); transformers' "
                         "torchvision processors resize such images bicubically below torchvision 0.27")
    if backend == "pil":
        out = np.empty((images.shape[0], height, width, images.shape[1]), dtype=np.uint8)
        for i, img in enumerate(images.permute(0, 2, 3, 1).cpu().numpy()):
            out[i] = np.asarray(Image.fromarray(img).resize((width, height), _PIL_RESAMPLE[resample]))
        return torch.from_numpy(out).permute(0, 3, 1, 2).to(images.device)
    if images.device.type == "cpu":
        return F.interpolate(images, size=(height, width), mode=resample, align_corners=False,
                             antialias=True)
    out = F.interpolate(images.float(), size=(height, width), mode=resample, align_corners=False,
                        antialias=True)
    return out.clamp_(0, 255).round_().to(torch.uint8)


def rescale_normalize(
    images: torch.Tensor,
    *,
    rescale_factor: float,
    mean: Sequence[float],
    std: Sequence[float],
    do_rescale: bool,
    do_normalize: bool,
    backend: str,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 [..., C, H, W] -> float32 [..., C, H, W] with the backend's exact arithmetic.
    out: a float32 tensor of the same shape to write into (returned)."""
    c = images.shape[-3]
    if backend == "pil":
        x = images.double() * rescale_factor if do_rescale else images
        x = x.float()
        if do_normalize:
            m = to_device(torch.tensor(mean, dtype=torch.float32), x.device).view(c, 1, 1)
            s = to_device(torch.tensor(std, dtype=torch.float32), x.device).view(c, 1, 1)
            x = (x - m) / s
        return x if out is None else out.copy_(x)
    if do_normalize:
        m = to_device(torch.tensor(mean), images.device)  # float32, as transformers builds them
        s = to_device(torch.tensor(std), images.device)
        if do_rescale:  # transformers fuses the rescale into mean/std
            m, s = m * (1.0 / rescale_factor), s * (1.0 / rescale_factor)
        # (float(x) - m) / s in float32, written once: uint8 - float32 promotes to float32
        return torch.sub(images, m.view(c, 1, 1), out=out).div_(s.view(c, 1, 1))
    x = images.float()
    x = x * rescale_factor if do_rescale else x
    return x if out is None else out.copy_(x)


def stack_hwc(images: Sequence[np.ndarray], device: torch.device | str | None = None) -> torch.Tensor:
    """list of same-size uint8 [H, W, C] -> uint8 [B, C, H, W] (one copy)."""
    t = torch.from_numpy(np.stack(images))  # copies, so read-only inputs are fine
    t = t.permute(0, 3, 1, 2).contiguous()
    return t if device is None else t.to(device)
