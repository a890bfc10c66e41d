"""Image loading: paths, bytes, PIL images and numpy arrays -> RGB uint8 arrays [H, W, 3].

Accepted inputs (one image each):
  * str / pathlib.Path: a file PIL can decode; EXIF orientation is applied.
  * bytes / bytearray / memoryview: an encoded image file held in memory.
  * PIL.Image.Image: any mode; converted as below.
  * numpy.ndarray: [H, W] grayscale, [H, W, 1], [H, W, 3] RGB or [H, W, 4] RGBA, dtype uint8,
    or a floating dtype with values in [0, 1] (mapped to uint8 by round(x * 255)).
    Channels-first arrays are not guessed: pass [H, W, C].

Colour conversion matches transformers' `convert_to_rgb` for PIL images: an image with an alpha
channel (or a palette with a transparency entry) is composited onto white, everything else goes
through `Image.convert("RGB")`. RGBA arrays go through the same PIL path.

Errors are `ImageLoadError` (a ValueError) naming the input (its path, or "image #i") and the
reason: missing/unreadable file, empty file, not an image, truncated/corrupt data, zero-size
image, decompression bomb (more pixels than `max_pixels`), wrong array shape or dtype.

A file with several frames (an animated GIF/WebP/PNG, a multi-page TIFF) loads as its first frame,
with a warning naming it; pass its frames to `preprocess_video` to use all of them.
"""
import dataclasses
import io
import logging
import os
import pathlib
import re
import warnings
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from mmenc.logger import init_logger

logger = init_logger(__name__)


_ORIENTATION = 0x0112  # the EXIF Orientation tag; values 2..8 flip or rotate the image
_ROTATED = frozenset(range(2, 9))


class ImageLoadError(ValueError):
    """An input could not be turned into an RGB image; the message names the input and why."""


@dataclasses.dataclass(frozen=True)
class LoadFailure:
    index: int  # position in the input list
    name: str  # the path, or "image #i"
    message: str  # why it failed


def size_text(width: int, height: int) -> str:
    """An image size as every mmenc message writes it: named values, width first ("width=640 height=480")."""
    return f"width={width} height={height}"


def without_reprs(error: BaseException | str) -> str:
    """An error's text without Python object reprs ("<_io.BytesIO object at 0x7f...>" -> "the image data"):
    what PIL puts in some messages means nothing to the person who sent the image."""
    return _REPR.sub("the image data", str(error))


_REPR = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def _default_max_pixels() -> int | None:
    return Image.MAX_IMAGE_PIXELS


def _name(item: Any, index: int | None) -> str:
    if isinstance(item, (str, pathlib.Path)):
        return f"'{os.fspath(item)}'"
    return "image" if index is None else f"image #{index}"


HIGH_BIT_DEPTH = ("clip", "scale")
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16B", "I;16L", "I;16N", "I"})


def _pil_to_rgb(img: Image.Image, name: str = "image", high_bit_depth: str = "clip") -> np.ndarray:
    if img.mode in _SIXTEEN_BIT_MODES:  # 16-bit (or 32-bit integer) grayscale, e.g. a 16-bit PNG
        if high_bit_depth == "scale":
            values = np.asarray(img, dtype=np.float64)  # 0..65535
            gray = np.clip(np.rint(values * (255.0 / 65535.0)), 0, 255).astype(np.uint8)
            return np.ascontiguousarray(np.repeat(gray[:, :, None], 3, axis=2))
        from mmenc.logger import log_once

        log_once(logger, f"{name} is a 16-bit image (PIL mode {img.mode}): converted as transformers converts it "
                         f"(values over 255 clip, so it comes out almost white), for parity; "
                         f"high_bit_depth='scale' (mmenc encode --high-bit-depth scale) maps 0..65535 onto 0..255 "
                         f"instead (said once per process)", level=logging.WARNING, key="16-bit images")
    has_alpha = "A" in img.getbands() or img.info.get("transparency") is not None
    if has_alpha:
        rgba = img.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, rgba)
    if img.mode != "RGB":
        img = img.convert("RGB")
    return np.asarray(img)


def _note_frames(img: Image.Image, name: str) -> None:
    """Warn when `img` holds several frames: only the first is encoded."""
    frames = getattr(img, "n_frames", 1)
    if frames > 1:
        logger.warning("%s has %d frames (animated or multi-page %s); encoding its first frame only "
                       "(to use every frame, pass them to preprocess_video)", name, frames, img.format or "image")


def _open_encoded(src: Any, name: str, max_pixels: int | None) -> Image.Image:
    with warnings.catch_warnings():
        # We apply our own limit below; PIL's warning threshold is only its default.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(src)
        except Image.DecompressionBombError as e:
            raise ImageLoadError(f"{name}: decompression bomb refused by PIL ({e}); if the image is trusted, "
                                 f"raise PIL.Image.MAX_IMAGE_PIXELS (mmenc encode --max-image-pixels)") from e
        except UnidentifiedImageError as e:
            raise ImageLoadError(f"{name}: not an image (PIL cannot identify the format)") from e
        w, h = img.size
        if w == 0 or h == 0:
            raise ImageLoadError(f"{name}: zero-size image ({size_text(w, h)})")
        if max_pixels is not None and w * h > max_pixels:
            raise ImageLoadError(
                f"{name}: decompression bomb: {size_text(w, h)} = {w * h} pixels exceeds max_pixels={max_pixels}; "
                f"raise max_pixels if the image is trusted (mmenc encode --max-image-pixels)")
        _note_frames(img, name)
        try:
            img.load()
            if img.getexif().get(_ORIENTATION, 1) in _ROTATED:  # else exif_transpose would only copy the image
                img = ImageOps.exif_transpose(img)
        except (OSError, SyntaxError, ValueError) as e:
            raise ImageLoadError(f"{name}: corrupt or truncated image data ({without_reprs(e)})") from e
    return img


def _load_path(path: str | pathlib.Path, name: str, max_pixels: int | None) -> Image.Image:
    path = pathlib.Path(path)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ImageLoadError(f"{name}: cannot read file ({e.strerror or e})") from e
    if path.is_dir():
        raise ImageLoadError(f"{name}: is a directory, expected an image file")
    if size == 0:
        raise ImageLoadError(f"{name}: empty file (0 bytes)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ImageLoadError(f"{name}: cannot read file ({e.strerror or e})") from e
    return _open_encoded(io.BytesIO(data), name, max_pixels)


def _array_to_rgb(a: np.ndarray, name: str) -> np.ndarray:
    if a.ndim == 3 and a.shape[-1] == 1:
        a = a[..., 0]
    if a.ndim not in (2, 3) or (a.ndim == 3 and a.shape[-1] not in (3, 4)):
        raise ImageLoadError(
            f"{name}: array shape {tuple(a.shape)} not supported; expected [H, W], [H, W, 1], "
            f"[H, W, 3] or [H, W, 4] (channels last)")
    if a.shape[0] == 0 or a.shape[1] == 0:
        raise ImageLoadError(f"{name}: zero-size image (array shape {tuple(a.shape)})")
    if np.issubdtype(a.dtype, np.floating):
        lo, hi = float(np.min(a)), float(np.max(a))
        if not (np.isfinite(lo) and np.isfinite(hi) and lo >= 0.0 and hi <= 1.0):
            raise ImageLoadError(
                f"{name}: float array values must lie in [0, 1], got [{lo}, {hi}]; "
                f"pass uint8 for 0..255 data")
        a = np.rint(a.astype(np.float64) * 255.0).astype(np.uint8)
    elif a.dtype != np.uint8:
        raise ImageLoadError(
            f"{name}: array dtype {a.dtype} not supported; expected uint8 (0..255) or float in [0, 1]")
    if a.ndim == 2:
        return np.ascontiguousarray(np.repeat(a[:, :, None], 3, axis=2))
    if a.shape[-1] == 4:
        return _pil_to_rgb(Image.fromarray(np.ascontiguousarray(a)))
    return np.ascontiguousarray(a)


def load_image(item: Any, *, index: int | None = None, max_pixels: int | None = -1,
               high_bit_depth: str = "clip") -> np.ndarray:
    """One input -> RGB uint8 array [H, W, 3] (C-contiguous).

    max_pixels: refuse encoded images (paths, bytes) with more pixels than this; -1 means PIL's
    `Image.MAX_IMAGE_PIXELS` read at call time, None means no limit of ours (PIL still refuses
    images over twice its own limit). high_bit_depth: 16-bit grayscale images (16-bit PNGs):
    "clip" converts them as transformers does (values over 255 clip: almost white; a warning, once),
    "scale" maps 0..65535 onto 0..255. Raises ImageLoadError.
    """
    if high_bit_depth not in HIGH_BIT_DEPTH:
        raise ValueError(f"high_bit_depth={high_bit_depth!r} is not valid; expected 'clip' (transformers' "
                         f"conversion) or 'scale' (0..65535 onto 0..255)")
    name = _name(item, index)
    limit = _default_max_pixels() if max_pixels == -1 else max_pixels
    if isinstance(item, (str, pathlib.Path)):
        return _pil_to_rgb(_load_path(item, name, limit), name, high_bit_depth)
    if isinstance(item, (bytes, bytearray, memoryview)):
        if len(item) == 0:
            raise ImageLoadError(f"{name}: empty bytes (0 bytes)")
        return _pil_to_rgb(_open_encoded(io.BytesIO(bytes(item)), name, limit), name, high_bit_depth)
    if isinstance(item, Image.Image):
        if item.width == 0 or item.height == 0:
            raise ImageLoadError(f"{name}: zero-size image ({size_text(item.width, item.height)})")
        _note_frames(item, name)
        try:
            return _pil_to_rgb(item, name, high_bit_depth)
        except (OSError, ValueError) as e:
            raise ImageLoadError(f"{name}: cannot convert PIL image of mode {item.mode} ({e})") from e
    if isinstance(item, np.ndarray):
        return _array_to_rgb(item, name)
    raise ImageLoadError(
        f"{name}: unsupported input type {type(item).__name__}; expected a path, bytes, "
        f"PIL.Image.Image or numpy.ndarray")


def load_images(
    items: Sequence[Any],
    errors: Literal["raise", "skip"] = "raise",
    *,
    max_pixels: int | None = -1,
) -> tuple[list[np.ndarray], list[LoadFailure]]:
    """Load a batch; returns (images, failures).

    Partial-failure contract: every input is tried, in order, whatever happens to the others.
      errors="raise": if any input failed, raise one ImageLoadError whose message lists every
        failed input (index, name, reason); otherwise return (images, []).
      errors="skip": return the images that loaded, in input order, and the list of failures
        (LoadFailure(index, name, message)); the caller maps images back with the indices.
    images: RGB uint8 arrays [H, W, 3]. max_pixels: as in `load_image`.
    """
    if errors not in ("raise", "skip"):
        raise ValueError(f"errors={errors!r} not supported; expected 'raise' or 'skip'")
    images, failures = [], []
    for i, item in enumerate(items):
        try:
            images.append(load_image(item, index=i, max_pixels=max_pixels))
        except ImageLoadError as e:
            failures.append(LoadFailure(i, _name(item, i), str(e)))
    if failures and errors == "raise":
        lines = "\n".join(f"  [{f.index}] {f.message}" for f in failures)
        raise ImageLoadError(f"{len(failures)} of {len(items)} images failed to load:\n{lines}")
    return images, failures


def process_by_size(images: Sequence[Any], process) -> tuple[torch.Tensor, torch.Tensor]:
    """Load `images` (raising ImageLoadError for the first bad one), call `process(arrays)` once per
    distinct input size with that size's RGB uint8 arrays [H, W, 3], and put the results back in
    input order. `process` returns (patches [n, rows, ...] for its n images, grid [t, h, w]).
    Returns (patches of every image concatenated along rows, grid_thw int64 [N, 3])."""
    arrays = [load_image(im, index=i) for i, im in enumerate(images)]
    if not arrays:
        raise ValueError("images is empty; pass at least one image")
    groups: dict[tuple[int, int], list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(a.shape[:2], []).append(i)
    out: list[Any] = [None] * len(arrays)
    grids: list[Any] = [None] * len(arrays)
    for idx in groups.values():  # one batched resize per input size
        patches, grid = process([arrays[i] for i in idx])
        for j, i in enumerate(idx):
            out[i], grids[i] = patches[j], list(grid)
    return torch.cat(out, 0), torch.tensor(grids, dtype=torch.int64)
