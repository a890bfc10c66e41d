"""Processors of the OCR-lineage towers: transformers' PaddleOCRVLImageProcessor, HunYuanVLImageProcessor
and Ernie4_5_VLMoeImageProcessor (images only).

All three are the Qwen2-VL algorithm (bicubic resize to multiples of patch*merge within a pixel
budget, rescale, normalize) with temporal_patch_size 1. They differ in:
  ERNIE-4.5-VL   patches in merge-block order, rows [C*p*p]             -> QwenVLProcessor as is
  HunyuanOCR     patches in raster order, rows [C*p*p]                  -> RasterPatchProcessor
  PaddleOCR-VL   raster order, rows [C, p, p]; sides shorter than patch*merge are first scaled up to it
                 (aspect kept)                                          -> RasterPatchProcessor(upscale_small=True)
Output: pixel_values float32 [sum h*w, ...row shape], grid_thw int64 [N, 3] rows (1, h, w), input order.
"""
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mmenc.preprocess.plan import ImagePlan
from mmenc.preprocess.qwen_vl import QwenVLProcessor, QwenVLProcessorConfig, smart_resize


def upscale_small_sides(height: int, width: int, factor: int) -> tuple[int, int]:
    """PaddleOCR-VL: a side below `factor` becomes `factor`, the other scaled to keep the aspect ratio."""
    if height < factor:
        width, height = round(width * factor / height), factor
    if width < factor:
        height, width = round(height * factor / width), factor
    return height, width


class RasterPatchProcessor(QwenVLProcessor):
    """QwenVLProcessor with patches in raster order (row-major over the h x w patch grid) and images only.

    upscale_small: PaddleOCR-VL's pre-scaling of short sides; pixel_shape: "flat" -> rows [C*tp*p*p],
    "chw" -> rows [C*tp, p, p].
    """

    def __init__(self, config: QwenVLProcessorConfig, device=None, *, upscale_small: bool = False,
                 pixel_shape: str = "flat"):
        super().__init__(config, device)
        if pixel_shape not in ("flat", "chw"):
            raise ValueError(f"pixel_shape={pixel_shape!r}; expected 'flat' or 'chw'")
        self.upscale_small, self.pixel_shape = upscale_small, pixel_shape

    def target_size(self, height: int, width: int, num_frames: int = 1, video: bool = False) -> tuple[int, int]:
        if video:
            raise ValueError("this processor takes images only (its model has no video input); pass still images")
        c = self.config
        if self.upscale_small:
            height, width = upscale_small_sides(height, width, c.factor)
        return smart_resize(height, width, c.factor, c.min_pixels, c.max_pixels)

    def _raster(self, x: torch.Tensor) -> torch.Tensor:
        """[..., C, h, w] -> [..., h/p * w/p, C, tp*p*p], the image repeated tp times per patch."""
        c = self.config
        p, tp = c.patch_size, c.temporal_patch_size
        *lead, ch, h, w = x.shape
        n = len(lead)
        x = x.reshape(*lead, ch, h // p, p, w // p, p).permute(*range(n), n + 1, n + 3, n, n + 2, n + 4)
        x = x.unsqueeze(-3).expand(*x.shape[:-2], tp, p, p)  # ..., h/p, w/p, C, tp, p, p
        return x.reshape(*lead, (h // p) * (w // p), ch, tp * p * p)

    def _to_patches(self, frames: torch.Tensor, height: int, width: int) -> tuple[torch.Tensor, list[int]]:
        """uint8 [B, 1, C, H, W] -> float32 [B, h*w, C*p*p] (raster), [1, h, w]."""
        c = self.config
        x = self._resize_normalize(frames, height, width)
        h, w = x.shape[-2:]
        patches = self._raster(x)
        return patches.flatten(-2), [1, h // c.patch_size, w // c.patch_size]

    def patchify(self, image: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """Resized uint8 [C, h, w] -> uint8 [rows, C, tp*p*p], patches in raster order."""
        return self._raster(image.contiguous())

    def as_pixel_values(self, x: torch.Tensor) -> torch.Tensor:
        """normalize's float32 [P, C, tp*p*p] -> [P, C*tp*p*p] ("flat") or [P, C*tp, p, p] ("chw")."""
        if self.pixel_shape == "chw":
            p = self.config.patch_size
            return x.reshape(x.shape[0], -1, p, p)
        return x.reshape(x.shape[0], -1)

    def __call__(self, images: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        pixel_values, grid_thw = super().__call__(images)
        return self.as_pixel_values(pixel_values.reshape(pixel_values.shape[0], *self.row_shape)), grid_thw

    def preprocess_video(self, frames: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        raise ValueError("this processor takes images only (its model has no video input); pass still images")


def _preset(**kw) -> QwenVLProcessorConfig:
    return QwenVLProcessorConfig(temporal_patch_size=1, **kw)


# transformers' class defaults (used for keys a checkpoint's preprocessor_config.json leaves out)
PADDLEOCR_VL = _preset(patch_size=14, min_pixels=384 * 384, max_pixels=1536 * 1536)
HUNYUAN_VL = _preset(patch_size=16, min_pixels=512 * 512, max_pixels=2048 * 2048)
ERNIE4_5_VL = _preset(patch_size=14, min_pixels=56 * 56, max_pixels=28 * 28 * 6177)


def paddleocr_vl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                         **overrides) -> RasterPatchProcessor:
    """PaddleOCR-VL: PaddleOCRVLImageProcessor (rows [C, p, p])."""
    config = QwenVLProcessorConfig.from_hf(d, None, defaults=PADDLEOCR_VL, **overrides)
    return RasterPatchProcessor(config, upscale_small=True, pixel_shape="chw")


def hunyuan_vl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                       **overrides) -> RasterPatchProcessor:
    """HunyuanOCR: HunYuanVLImageProcessor (always bicubic, whatever `resample` its config names)."""
    return RasterPatchProcessor(QwenVLProcessorConfig.from_hf(d, None, defaults=HUNYUAN_VL, **overrides))


def ernie4_5_vl_from_hf(d: Mapping[str, Any] | None = None, video: Mapping[str, Any] | None = None,
                        **overrides) -> QwenVLProcessor:
    """ERNIE-4.5-VL: Ernie4_5_VLMoeImageProcessor (merge-block order, temporal_patch_size 1)."""
    d = {k: v for k, v in dict(d or {}).items() if k != "temporal_patch_size"}  # its images ignore it
    return QwenVLProcessor(QwenVLProcessorConfig.from_hf(d, None, defaults=ERNIE4_5_VL, **overrides))
