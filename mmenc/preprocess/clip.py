"""CLIP-style processors: transformers' CLIPImageProcessor, LlavaImageProcessor and (inside LLaVA
checkpoints) SiglipImageProcessor, with their *Pil twins for backend="pil", as mmenc's packed patches.

Per image of H x W pixels, in transformers' order (every step on uint8):
  * do_pad (LlavaImageProcessor): pad to a max(H, W) square, the image centred ((side - size) // 2
    before it), filled with int(mean * 255) per channel;
  * resize (bicubic unless the config says `resample: 2`): size {"shortest_edge": S} scales the
    shorter side to S and the longer to int(S * long / short); {"height", "width"} is a fixed size;
  * do_center_crop to crop_size, top/left = (size - crop) // 2; a side shorter than the crop is
    zero-padded around it (PIL: ceil of half the gap before it; torchvision: floor);
  * rescale, normalize (OpenAI CLIP mean/std; SigLIP 0.5).
The patch convolution drops a partial last patch: pixel_values rows are the (C, p, p) patches of the
top-left (H // p) x (W // p) patches in raster order; grid_thw rows (1, H // p, W // p).
"""
import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import (PatchProcessor, check_positive_ints, hf_keys, hf_resample, hf_rescale_normalize,
                                   resize_exact)
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess.qwen_vl import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from mmenc.preprocess.images import size_text



@dataclasses.dataclass(frozen=True)
class ClipProcessorConfig:
    """shortest_edge > 0: resize the shorter side to it (else to height x width); crop: do_center_crop to
    crop_height x crop_width. Defaults: transformers' CLIPImageProcessor (224 px, OpenAI mean/std)."""

    patch_size: int = 32
    shortest_edge: int = 224
    height: int = 224
    width: int = 224
    crop: bool = True
    crop_height: int = 224
    crop_width: int = 224
    pad_to_square: bool = False
    resample: str = "bicubic"
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "height", "width", "crop_height", "crop_width"),
                            prefix="ClipProcessorConfig.")
        if not isinstance(self.shortest_edge, int) or self.shortest_edge < 0:
            raise ValueError(f"ClipProcessorConfig.shortest_edge={self.shortest_edge!r}; expected a size in pixels "
                             f"(0: resize to height x width)")
        if self.resample not in ("bilinear", "bicubic"):
            raise ValueError(f"ClipProcessorConfig.resample={self.resample!r}; expected 'bilinear' or 'bicubic' "
                             f"(PIL codes 2 and 3)")
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None = None, siglip: bool = False, **overrides) -> "ClipProcessorConfig":
        """From a preprocessor_config.json dict; siglip=True: SiglipImageProcessor's defaults (fixed size,
        no crop, mean/std 0.5) under what the dict sets."""
        d = dict(d or {})
        kw: dict[str, Any] = ({"shortest_edge": 0, "crop": False, "image_mean": (0.5,) * 3, "image_std": (0.5,) * 3}
                              if siglip else {})
        size = d.get("size")
        if isinstance(size, int):  # old configs: an int shortest edge
            size = {"shortest_edge": size}
        size = size or {}
        if size.get("shortest_edge") is not None:
            kw["shortest_edge"] = int(size["shortest_edge"])
        elif size.get("height") is not None:
            kw.update(shortest_edge=0, height=int(size["height"]), width=int(size.get("width", size["height"])))
        crop = d.get("crop_size")
        if isinstance(crop, int):
            crop = {"height": crop, "width": crop}
        if crop:
            kw.update(crop_height=int(crop["height"]), crop_width=int(crop["width"]))
        if d.get("do_center_crop") is not None and not siglip:
            kw["crop"] = bool(d["do_center_crop"])
        if d.get("do_pad") is not None and not siglip:
            kw["pad_to_square"] = bool(d["do_pad"])
        kw.update(hf_resample(d))
        kw.update(hf_keys(d, ("patch_size", "do_resize", "do_rescale", "do_normalize")))
        kw.update(hf_rescale_normalize(d))
        return cls(**{**kw, **overrides})


def resized_size(height: int, width: int, config: ClipProcessorConfig) -> tuple[int, int]:
    """(h, w) after the resize step (get_resize_output_image_size with default_to_square=False)."""
    if not config.do_resize:
        return height, width
    if not config.shortest_edge:
        return config.height, config.width
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = config.shortest_edge, int(config.shortest_edge * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(image: torch.Tensor, height: int, width: int, backend: str) -> torch.Tensor:
    """uint8 [C, H, W] -> uint8 [C, height, width], as the backend's center_crop (zero padding where a
    side is shorter than the crop: PIL puts ceil(gap / 2) before the image, torchvision floor)."""
    c, h, w = image.shape
    if h >= height and w >= width:
        top, left = (h - height) // 2, (w - width) // 2
        return image[:, top:top + height, left:left + width]
    new_h, new_w = max(h, height), max(w, width)
    if backend == "pil":
        pad_top, pad_left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    else:
        pad_top, pad_left = (new_h - h) // 2, (new_w - w) // 2
    canvas = image.new_zeros(c, new_h, new_w)
    canvas[:, pad_top:pad_top + h, pad_left:pad_left + w] = image
    top, left = (new_h - height) // 2, (new_w - width) // 2
    return canvas[:, top:top + height, left:left + width]


def pad_to_square(image: torch.Tensor, fill: tuple[int, ...]) -> torch.Tensor:
    """uint8 [C, H, W] -> uint8 [C, S, S], S = max(H, W), the image centred on `fill` (one value per channel)."""
    c, h, w = image.shape
    if h == w:
        return image
    side = max(h, w)
    canvas = torch.tensor(fill, dtype=image.dtype).view(c, 1, 1).expand(c, side, side).to(image.device).clone()
    top, left = (side - h) // 2, (side - w) // 2
    canvas[:, top:top + h, left:left + w] = image
    return canvas


class ClipProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C, p, p], grid_thw int64 [N, 3] = (1, H // p, W // p));
    see the module docstring."""

    config_class = ClipProcessorConfig

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        c, p = self.config, self.config.patch_size
        if height < 1 or width < 1:
            raise ImagePreprocessError(f"size {size_text(width, height)} is empty", index=index, name=name)
        side = max(height, width)
        h, w = resized_size(side, side, c) if c.pad_to_square else resized_size(height, width, c)
        final = (c.crop_height, c.crop_width) if c.crop else (h, w)
        if final[0] < p or final[1] < p:
            raise ImagePreprocessError(f"size {size_text(final[1], final[0])} after resizing is smaller than one {p}x{p} "
                                       f"patch; keep do_resize=True or use a larger image", index=index, name=name)
        gh, gw = final[0] // p, final[1] // p
        return ImagePlan(size=(height, width), resize=(h, w), padded=final, grid=(1, gh, gw), rows=gh * gw)

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, *plan.padded]: pad to square, resize, centre crop (as configured)."""
        c = self.config
        if c.pad_to_square:
            image = pad_to_square(image, tuple(int(m * 255) for m in c.image_mean))
        h, w = plan.resize
        if tuple(image.shape[1:]) != (h, w):
            if c.resample == "bicubic":
                image = resize_exact(image, h, w, c.backend)
            else:
                image = ops.resize_uint8(image[None], h, w, c.backend, resample=c.resample)[0]
        if c.crop:
            image = center_crop(image, c.crop_height, c.crop_width, c.backend)
        return image

    def patchify(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [gh*gw, C, p, p], raster order; a partial last patch is dropped."""
        p, (_, gh, gw) = self.config.patch_size, plan.grid
        x = image[:, :gh * p, :gw * p].contiguous().view(image.shape[0], gh, p, gw, p).permute(1, 3, 0, 2, 4)
        return x.reshape(gh * gw, image.shape[0], p, p)


def clip_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                 **overrides) -> ClipProcessor:
    """CLIP's processor (CLIPImageProcessor / LlavaImageProcessor, or SiglipImageProcessor when the
    preprocessor_config.json names it: LLaVA checkpoints with a SigLIP tower)."""
    siglip = str((d or {}).get("image_processor_type", "")).startswith("Siglip")
    return ClipProcessor(ClipProcessorConfig.from_hf(d, siglip=siglip, **overrides))
