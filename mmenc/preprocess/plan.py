"""Per-image preprocessing plans and per-image failures.

A processor's `plan(height, width, index=, name=)` decides, from an image's size alone, what its
preprocessing will do (resize target, padding, patch grid) or raises `ImagePreprocessError` for
that image only (aspect ratio over 200, a size the config cannot patchify, ...). The pipeline
(mmenc.preprocess.pipeline) plans every image in its worker thread, so one bad image becomes one
failure under errors="skip" instead of failing the batch.
"""
import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmenc.preprocess.images import ImageLoadError, LoadFailure


class ImagePreprocessError(ImageLoadError):
    """One input cannot be preprocessed; carries its position, its name and the reason.

    An ImageLoadError (so a ValueError) so that callers catching load errors catch it too."""

    def __init__(self, reason: str, *, index: int | None = None, name: str | None = None):
        self.index = index
        self.name = name if name is not None else ("image" if index is None else f"image #{index}")
        self.reason = reason
        super().__init__(f"{self.name}: {reason}")

    def failure(self) -> LoadFailure:
        return LoadFailure(-1 if self.index is None else self.index, self.name, str(self))


@dataclasses.dataclass(frozen=True)
class ImagePlan:
    """What preprocessing does to one image of `size` (height, width).

    resize: (h, w) after the bicubic resize (== size when there is none);
    padded: (h, w) after zero padding bottom/right (== resize when there is none; Kimi pads);
    grid: the image's grid_thw row (t, h, w), for anyres families (LLaVA-NeXT, OneVision) followed by the
    image's (height, width) in pixels; rows: its rows in pixel_values (t * h * w).
    """

    size: tuple[int, int]
    resize: tuple[int, int]
    padded: tuple[int, int]
    grid: tuple[int, ...]
    rows: int


def finish_patches(processor: Any, patches: Sequence[torch.Tensor], plans: Sequence[ImagePlan], *,
                   normalize_parts: Callable[[list], Any] | None = None,
                   normalizers: Sequence[Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image uint8 patches [rows_i, *processor.row_shape] (one device) -> (pixel_values float32,
    grid_thw int64 [N, 3] on the CPU). The output is allocated once; by default the patches are
    concatenated and normalized into it in one call (what a GPU wants); `normalize_parts(list of
    (patches_i, out_rows_i))` instead normalizes each image into its rows, e.g. in worker threads
    (what a CPU wants: the first writes to fresh memory, page faults, then spread over threads).
    normalizers: per image, the processor whose `normalize` it takes (a chunk mixing images and video
    pieces, whose video processor may normalize with its own constants); None: `processor` for all."""
    rows = [list(row) for pl in plans for row in (getattr(pl, "grid_rows", None) or (pl.grid,))]  # a video piece: several
    columns = len(rows[0]) if rows else 3  # anyres images: (tiles, s, s, H, W)
    grid_thw = torch.tensor(rows, dtype=torch.int64).reshape(-1, columns)
    sizes = [p.shape[0] for p in patches]
    device = patches[0].device if patches else torch.device("cpu")
    out = torch.empty((sum(sizes), *processor.row_shape), dtype=torch.float32, device=device)
    if normalize_parts is not None and len(patches) > 1:
        normalize_parts(list(zip(patches, out.split(sizes))))
    elif normalizers is not None and any(n is not processor for n in normalizers):
        for n, part, dst in zip(normalizers, patches, out.split(sizes)):
            n.normalize(part, out=dst)
    elif patches:  # one concatenation (uint8), one normalize
        processor.normalize(torch.cat(list(patches)), out=out)
    return processor.as_pixel_values(out), grid_thw


def input_name(item: Any, index: int | None) -> str:
    """How messages name an input: its path in quotes, else "image #i" (as load_image does)."""
    if isinstance(item, (str, os.PathLike)):
        return f"'{os.fspath(item)}'"
    return "image" if index is None else f"image #{index}"
