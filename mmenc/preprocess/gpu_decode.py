"""JPEG decoding on the GPU with torchvision's nvJPEG binding (optional; the CPU path needs no torchvision).

Only plain baseline-style colour JPEGs go this way: PIL reads the header (cheap, no decode) and
anything else (PNG, grayscale, CMYK, an EXIF rotation, more pixels than the bomb limit) returns None
here and is decoded on the CPU by `load_image`, which also produces the proper per-image errors.
nvJPEG and libjpeg-turbo (PIL) do not produce identical pixels; see docs/preprocessing.md.
"""
import importlib.util
import io

import torch
from PIL import Image, UnidentifiedImageError

_ORIENTATION = 0x0112


def unavailable_reason(device: torch.device) -> str | None:
    """Why GPU decoding cannot run on `device` (None: it can)."""
    if device.type != "cuda":
        return f"device={device} is not a CUDA device"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (pip install torchvision matching your torch)"
    return None


def probe_jpeg(data: bytes, max_pixels: int | None) -> tuple[int, int] | None:
    """(height, width) of a colour JPEG the GPU can decode as PIL would orient it, else None."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG" or im.mode != "RGB":
                return None
            if im.getexif().get(_ORIENTATION, 1) != 1:
                return None
            w, h = im.size
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError):
        return None
    if w == 0 or h == 0 or (max_pixels is not None and w * h > max_pixels):
        return None
    return h, w


def decode_jpegs(datas: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | None]:
    """Encoded JPEGs (uint8 [n] CPU tensors) -> RGB uint8 [3, H, W] on `device`; None where nvJPEG
    failed (the caller decodes that one on the CPU)."""
    if not datas:
        return []
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=device))
    except RuntimeError:  # one bad stream fails the batch: retry one by one
        out: list[torch.Tensor | None] = []
        for d in datas:
            try:
                out.append(decode_jpeg(d, mode=ImageReadMode.RGB, device=device))
            except RuntimeError:
                out.append(None)
        return out
