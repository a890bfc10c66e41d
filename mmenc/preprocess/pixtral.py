"""Pixtral / Mistral3 processor: transformers' PixtralImageProcessor (and PixtralImageProcessorPil).

Native resolution: an image larger than `longest_edge` on either side is shrunk (aspect kept, sides
floored), then each side is rounded UP to a multiple of the resize multiple (patch_size, or for
Mistral3 patch_size * spatial_merge_size, which PixtralProcessor passes as the image processor's
patch_size) and resized there with bicubic; no padding is kept: transformers pads each batch to its
largest image, mmenc packs the images instead, so pixel_values hold only real patches.
Output: pixel_values float32 [P, C, p, p] (each image's patches in raster order), grid_thw
int64 [N, 3] = [1, h/p, w/p] with p the tower's patch size.
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, hf_rescale_normalize, resize_exact
from mmenc.preprocess.images import process_by_size, size_text
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def pixtral_resize(height: int, width: int, longest_edge: int, multiple: int) -> tuple[int, int]:
    """transformers' Pixtral target size: shrink to fit longest_edge x longest_edge (floored), then
    each side up to a multiple of `multiple`."""
    ratio = max(height / longest_edge, width / longest_edge)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    return ((height - 1) // multiple + 1) * multiple, ((width - 1) // multiple + 1) * multiple


def _edge(value: Any, key: str) -> int:
    """An int, or a {"height": n, "width": n} dict with equal sides -> n."""
    if isinstance(value, Mapping):
        if value.get("height") != value.get("width"):
            raise ValueError(f"{key}={dict(value)}: height and width must be equal")
        value = value["height"]
    return int(value)


@dataclasses.dataclass(frozen=True)
class PixtralProcessorConfig:
    patch_size: int = 16
    merge_size: int = 1  # resize to multiples of patch_size * merge_size (Mistral3: 2)
    longest_edge: int = 1024
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "merge_size", "longest_edge"), prefix="PixtralProcessorConfig.")
        ops.check_backend(self.backend)

    @property
    def multiple(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, merge_size: int = 1, **overrides) -> "PixtralProcessorConfig":
        """From a preprocessor_config.json dict ({} for transformers' defaults)."""
        d, kw = dict(d or {}), {"merge_size": int(d.get("spatial_merge_size", merge_size)) if d else merge_size}
        if d.get("patch_size") is not None:
            kw["patch_size"] = _edge(d["patch_size"], "patch_size")
        size = d.get("size") or {}
        if size.get("longest_edge") is not None:
            kw["longest_edge"] = int(size["longest_edge"])
        elif size.get("height") is not None:
            kw["longest_edge"] = _edge(size, "size")
        for k in ("do_resize", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = bool(d[k])
        kw.update(hf_rescale_normalize(d))
        kw.update(overrides)
        return cls(**kw)


class PixtralProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] = [1, h/p, w/p])."""

    config_class = PixtralProcessorConfig

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        """What preprocessing does to one image of height x width, or ImagePreprocessError naming it."""
        c, p = self.config, self.config.patch_size
        if c.do_resize:
            h, w = pixtral_resize(height, width, c.longest_edge, c.multiple)
        else:
            h, w = height, width
            if h % c.multiple or w % c.multiple:
                raise ImagePreprocessError(f"size {size_text(w, h)} is not a multiple of {c.multiple} (patch_size * merge); "
                                           f"keep do_resize=True", index=index, name=name)
        return ImagePlan(size=(height, width), resize=(h, w), padded=(h, w), grid=(1, h // p, w // p),
                         rows=(h // p) * (w // p))

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, *plan.resize]; off the CPU `resize_uint8_exact` (the CPU kernel's bytes)."""
        h, w = plan.resize
        if tuple(image.shape[-2:]) == (h, w):
            return image
        return resize_exact(image, h, w, self.config.backend)

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        def process(arrays):
            x = ops.stack_hwc(arrays, self.device)  # uint8 [B, C, H, W], one size
            plan = self.plan(x.shape[-2], x.shape[-1])
            if self.config.do_resize:
                x = ops.resize_uint8(x, *plan.resize, self.config.backend)
            patches = torch.stack([self.patchify(im, plan) for im in x])  # uint8 [B, rows, C, p, p]
            return self.normalize(patches), plan.grid

        return process_by_size(images, process)

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("Pixtral takes images only; pass the frames as images (encode(frames))")


def pixtral_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                    **overrides) -> PixtralProcessor:
    """Pixtral-12B (Llava) processor from a preprocessor_config.json dict ({} for transformers' defaults)."""
    return PixtralProcessor(PixtralProcessorConfig.from_hf(d, **overrides))


def mistral3_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                     **overrides) -> PixtralProcessor:
    """Mistral Small 3.x processor: Pixtral's, resizing to multiples of patch_size * 2 (the spatial
    merge; PixtralProcessor's spatial_merge_size, read from the dict when present), patch 14 by default."""
    defaults = {"patch_size": 14, "size": {"longest_edge": 1540}}
    return PixtralProcessor(PixtralProcessorConfig.from_hf({**defaults, **dict(d or {})}, merge_size=2, **overrides))
