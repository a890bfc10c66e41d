"""SigLIP and SigLIP2 (NaFlex) processors: transformers' SiglipImageProcessor / Siglip2ImageProcessor
(and their *Pil twins with backend="pil"), as mmenc's packed patches.

  SigLIP:  resize to a fixed size (bicubic; Gemma 3's default is bilinear), rescale, normalize; the
           patch convolution drops a partial last patch, so an image of S px gives S // p patches per
           side. pixel_values rows: one (C, p, p) patch flattened -- the conv weight's order.
  SigLIP2: resize so that ceil(h / p) * ceil(w / p) <= max_num_patches (transformers' binary search on
           the scale, both sides multiples of p, at least one patch), bilinear; rows: one (p, p, C)
           patch flattened, as transformers' convert_image_to_patches; no padding to max_num_patches
           (the tower packs images, it does not pad them).
grid_thw rows are (1, h / p, w / p) (transformers' spatial_shapes with t = 1 prepended).
"""
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmenc.preprocess import ops
from mmenc.preprocess.base import PatchProcessor, check_positive_ints, hf_rescale_normalize
from mmenc.preprocess.images import load_image, size_text
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError

_RESAMPLE = {2: "bilinear", 3: "bicubic", "bilinear": "bilinear", "bicubic": "bicubic"}  # PIL enum -> name


def naflex_size(height: int, width: int, patch_size: int, max_num_patches: int, eps: float = 1e-5) -> tuple[int, int]:
    """SigLIP2's target size: the largest scale (bisected to `eps`) whose sides, rounded up to multiples
    of patch_size (at least one patch), make at most max_num_patches patches."""
    def scaled(scale: float, size: int) -> int:
        return int(max(patch_size, math.ceil(size * scale / patch_size) * patch_size))

    low, high = eps / 10, 100.0
    while high - low >= eps:
        mid = (low + high) / 2
        if (scaled(mid, height) / patch_size) * (scaled(mid, width) / patch_size) <= max_num_patches:
            low = mid
        else:
            high = mid
    return scaled(low, height), scaled(low, width)


@dataclasses.dataclass(frozen=True)
class SiglipProcessorConfig:
    """naflex: SigLIP2's variable size (max_num_patches) instead of SigLIP's fixed (height, width)."""

    naflex: bool = False
    patch_size: int = 16
    height: int = 224
    width: int = 224
    max_num_patches: int = 256
    resample: str = "bicubic"
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    backend: str = "torchvision"

    def __post_init__(self):
        check_positive_ints(self, ("patch_size", "height", "width", "max_num_patches"), prefix="SiglipProcessorConfig.")
        if self.resample not in ("bilinear", "bicubic"):
            raise ValueError(f"SiglipProcessorConfig.resample={self.resample!r}; expected 'bilinear' or 'bicubic' "
                             f"(PIL codes 2 and 3)")
        ops.check_backend(self.backend)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any] | None, naflex: bool, **overrides) -> "SiglipProcessorConfig":
        """From a preprocessor_config.json dict ({} for transformers' defaults)."""
        d, kw = dict(d or {}), {"naflex": naflex, "resample": "bilinear" if naflex else "bicubic"}
        for k in ("patch_size", "max_num_patches", "do_resize", "do_rescale", "do_normalize"):
            if d.get(k) is not None:
                kw[k] = d[k]
        size = d.get("size") or {}
        for k in ("height", "width"):
            if size.get(k) is not None:
                kw[k] = int(size[k])
        if d.get("resample") is not None:
            if d["resample"] not in _RESAMPLE:
                raise ValueError(f"preprocessor_config resample={d['resample']!r} is not supported; expected 2 "
                                 f"(bilinear) or 3 (bicubic)")
            kw["resample"] = _RESAMPLE[d["resample"]]
        kw.update(hf_rescale_normalize(d))
        return cls(**{**kw, **overrides})


class SiglipProcessor(PatchProcessor):
    """images -> (pixel_values float32 [P, C*p*p], grid_thw int64 [N, 3] = [1, h/p, w/p]); see the module
    docstring for the row layout of each version. row_shape, normalize, finish: PatchProcessor's."""

    def __init__(self, config: SiglipProcessorConfig | None = None):
        self.config = config or SiglipProcessorConfig()

    def plan(self, height: int, width: int, *, index: int | None = None, name: str | None = None) -> ImagePlan:
        """What preprocessing does to one image of height x width."""
        c, p = self.config, self.config.patch_size
        if not c.do_resize:
            h, w = height, width
        elif c.naflex:
            h, w = naflex_size(height, width, p, c.max_num_patches)
        else:
            h, w = c.height, c.width
        if h < p or w < p:
            raise ImagePreprocessError(f"size {size_text(w, h)} is smaller than one {p}x{p} patch; keep do_resize=True",
                                       index=index, name=name)
        return ImagePlan(size=(height, width), resize=(h, w), padded=(h, w), grid=(1, h // p, w // p),
                         rows=(h // p) * (w // p))

    def resize_one(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [C, *plan.resize]."""
        h, w = plan.resize
        return ops.resize_uint8(image[None], h, w, self.config.backend, resample=self.config.resample)[0]

    def patchify(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [C, H, W] -> uint8 [gh*gw, C, p, p], row-major; a partial last patch is dropped."""
        p, (_, gh, gw) = self.config.patch_size, plan.grid
        x = image[:, :gh * p, :gw * p].contiguous().view(image.shape[0], gh, p, gw, p).permute(1, 3, 0, 2, 4)
        return x.reshape(gh * gw, image.shape[0], p, p)

    def as_pixel_values(self, x: torch.Tensor) -> torch.Tensor:
        """[P, C, p, p] -> [P, C*p*p] (SigLIP) or [P, p*p*C] (SigLIP2)."""
        if self.config.naflex:
            x = x.permute(0, 2, 3, 1)
        return x.reshape(x.shape[0], -1)

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        arrays = [load_image(im, index=i) for i, im in enumerate(images)]
        if not arrays:
            raise ValueError("images is empty; pass at least one image")
        plans = [self.plan(a.shape[0], a.shape[1], index=i) for i, a in enumerate(arrays)]
        resized = [self.resize_one(ops.stack_hwc([a])[0], pl) for a, pl in zip(arrays, plans)]
        return self.finish(resized, plans)


def siglip_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                   **overrides) -> SiglipProcessor:
    """SigLIP's processor (SiglipImageProcessor; PaliGemma's, Gemma 3's without pan-and-scan)."""
    return SiglipProcessor(SiglipProcessorConfig.from_hf(d, naflex=False, **overrides))


def gemma3_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                   **overrides) -> SiglipProcessor:
    """Gemma 3's processor (Gemma3ImageProcessor): SigLIP's fixed resize with bilinear as its default;
    pan-and-scan crops (do_pan_and_scan, off by default) are not supported and refused."""
    d = dict(d or {})
    if d.get("do_pan_and_scan"):
        raise ValueError("preprocessor_config do_pan_and_scan=True: mmenc's Gemma 3 processor does not make "
                         "pan-and-scan crops; set do_pan_and_scan to false (transformers' default)")
    if d.get("resample") is None:
        d["resample"] = "bilinear"  # Gemma3ImageProcessor's default (SigLIP's is bicubic)
    return SiglipProcessor(SiglipProcessorConfig.from_hf(d, naflex=False, **overrides))


def siglip2_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                    **overrides) -> SiglipProcessor:
    """SigLIP2's NaFlex processor (Siglip2ImageProcessor)."""
    return SiglipProcessor(SiglipProcessorConfig.from_hf(d, naflex=True, **overrides))
