"""LLaVA-NeXT / LLaVA-OneVision "anyres" geometry: pure functions of image sizes, shared by the
processor (which tiles the image) and the tower (which unpads and packs its features). Sizes are
(height, width); the rules and their rounding are transformers' (select_best_resolution,
get_patch_output_size, unpad_image, OneVision's anyres_max).

An anyres image is a base tile (the whole image resized to the tile size) and the tiles of a canvas of
`best_resolution` pixels, the image resized into it (aspect kept) and zero-padded around it. Its tower
features: the base tile's, then the canvas's rows of features with the padding cut off (`unpadded_region`),
for OneVision bilinearly shrunk past `max_tiles` tiles' worth (`anyres_max_size`), one learned newline
vector after each row.
"""
import math
from collections.abc import Sequence


def select_best_resolution(height: int, width: int, pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """The canvas (h, w) of `pinpoints` that keeps most of the image's pixels, then wastes the fewest."""
    best, most, least = None, 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = w * h - effective
        if effective > most or (effective == most and wasted < least):
            best, most, least = (int(h), int(w)), effective, wasted
    if best is None:
        raise ValueError(f"image_grid_pinpoints={list(pinpoints)} is empty; expected canvas sizes [[h, w], ...]")
    return best


def patch_output_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """(h, w) of the image resized into the `target` canvas, aspect kept (the canvas pads the rest)."""
    th, tw = target
    scale_w, scale_h = tw / width, th / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), th), tw
    return th, min(math.ceil(width * scale_h), tw)


def unpadded_region(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """The part of a rows x cols feature canvas that shows an image of height x width pixels (the padding cut
    symmetrically off one axis): (top, left, kept_rows, kept_cols)."""
    if width / height > cols / rows:
        new = int(round(height * (cols / width), 7))
        pad = (rows - new) // 2
        return pad, 0, rows - 2 * pad, cols
    new = int(round(width * (rows / height), 7))
    pad = (cols - new) // 2
    return 0, pad, rows, cols - 2 * pad


def anyres_max_size(rows: int, cols: int, side: int, max_tiles: int) -> tuple[int, int] | None:
    """OneVision's anyres_max_N: the size a rows x cols feature map is bilinearly shrunk to when it holds more
    than 1.1^2 * max_tiles tiles of side x side features; None when it is kept as it is."""
    ratio = math.sqrt(rows * cols / (max_tiles * side ** 2))
    if ratio <= 1.1:
        return None
    return int(rows // ratio), int(cols // ratio)
