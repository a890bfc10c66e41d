"""JPEG decoding with torchvision (optional; without it everything is decoded by PIL in `load_image`).

Two decoders: nvJPEG on the GPU (`decode_jpegs`, decode="gpu") and torchvision's libjpeg-turbo on
the CPU (`decode_jpeg_cpu`, decode="torchvision", what "auto" picks when torchvision imports). The
CPU one decodes in one call without the GIL, so a thread pool scales (8 x 1036 px JPEGs in 32
threads: 8.3 ms against PIL's 21-26 ms, H200 host, benchmarks/e2e_profile.py) and gave exactly PIL's
pixels there (max |diff| 0: both are libjpeg-turbo with its default integer IDCT and fancy
upsampling). nvJPEG's pixels differ from libjpeg-turbo's (up to 15 levels measured), so "gpu" is never chosen
automatically; see docs/preprocessing.md.

Only plain colour JPEGs go either way: PIL reads the header (cheap, no decode) and anything else
(PNG, grayscale, CMYK, an EXIF rotation, more pixels than the bomb limit; for the CPU decoder also
data that does not end with the JPEG end marker, e.g. a truncated file) returns None here and is
decoded by `load_image`, which also produces the proper per-image errors.
"""
import functools
import importlib.util
import io
import pathlib

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


@functools.cache
def cpu_decoder_reason() -> str | None:
    """Why torchvision's CPU JPEG decoder cannot be used here (None: it can); imports it once."""
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed (pip install torchvision matching your torch)"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except (ImportError, RuntimeError, OSError) as e:  # a torchvision built for another torch
        return f"torchvision does not import ({type(e).__name__}: {e})"
    return None


def jpeg_bytes(item) -> bytes | None:
    """The encoded bytes of a path or bytes input (None for other inputs, or a file that cannot be read:
    load_image then reports it)."""
    if isinstance(item, (str, pathlib.Path)):
        try:
            return pathlib.Path(item).read_bytes()
        except OSError:
            return None
    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    return None


def decode_jpeg_cpu(data: bytes) -> torch.Tensor | None:
    """A complete JPEG (ends with its end marker) -> RGB uint8 [3, H, W] by torchvision on the CPU (a
    view of [H, W, 3] memory), or None when the data looks truncated or the decoder refuses it."""
    if not data.endswith(b"\xff\xd9"):
        return None  # truncated (or trailing bytes): PIL decides, and names the failure
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB)
    except RuntimeError:
        return None
