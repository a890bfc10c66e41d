"""Image loading and transformers-exact image/video processors for every tower family.

A processor is built from a preprocessor_config.json dict ({} or None for transformers' defaults):
    proc = get_processor("qwen2_5_vl", config_dict)      # or qwen2_5_vl_from_hf(config_dict)
    pixel_values, grid_thw = proc(images)                # paths, bytes, PIL or numpy
    pixel_values, grid_thw = proc.preprocess_video(frames)
Many images, in parallel, per image (a bad one fails alone), finished on the tower's device:
    pre = Preprocessor(proc, device="cuda")              # mmenc.preprocess.pipeline
    pixel_values, grid_thw, failures = pre.run(images, errors="skip")
PROCESSORS is the one table of processors: tower families name their kind in it
(ModelSpec.processor_from_hf = mmenc.models.base.processor_for(kind)), tests and benchmarks read it.
"""
from collections.abc import Callable, Mapping
from typing import Any

from mmenc.preprocess.anyres import AnyresProcessor, llava_next_from_hf, llava_onevision_from_hf
from mmenc.preprocess.clip import ClipProcessor, clip_from_hf
from mmenc.preprocess.idefics3 import Idefics3Processor, idefics3_from_hf
from mmenc.preprocess.images import ImageLoadError, LoadFailure, load_image, load_images
from mmenc.preprocess.internvl import InternVLProcessor, internvl_from_hf
from mmenc.preprocess.kimi import KimiProcessor, KimiProcessorConfig, kimi_k25_from_hf
from mmenc.preprocess.ocr import RasterPatchProcessor, ernie4_5_vl_from_hf, hunyuan_vl_from_hf, paddleocr_vl_from_hf
from mmenc.preprocess.llama4 import Llama4Processor, llama4_from_hf
from mmenc.preprocess.ovis2 import Ovis2Processor, ovis2_from_hf
from mmenc.preprocess.pipeline import Chunk, Preprocessed, Preprocessor
from mmenc.preprocess.pixtral import PixtralProcessor, mistral3_from_hf, pixtral_from_hf
from mmenc.preprocess.plan import ImagePlan, ImagePreprocessError
from mmenc.preprocess.qwen_vl import (
    QwenVLProcessor,
    QwenVLProcessorConfig,
    glm4v_from_hf,
    qwen2_vl_from_hf,
    qwen3_vl_from_hf,
)
from mmenc.preprocess.siglip import (SiglipProcessor, SiglipProcessorConfig, gemma3_from_hf, siglip2_from_hf,
                                    siglip_from_hf)

qwen2_5_vl_from_hf = qwen2_vl_from_hf  # transformers maps qwen2_5_vl to the Qwen2-VL processor

PROCESSORS: dict[str, Callable[..., Any]] = {
    "qwen2_vl": qwen2_vl_from_hf,
    "qwen2_5_vl": qwen2_5_vl_from_hf,
    "qwen3_vl": qwen3_vl_from_hf,
    "glm4v": glm4v_from_hf,
    "kimi_k25": kimi_k25_from_hf,
    "siglip": siglip_from_hf,
    "siglip2": siglip2_from_hf,
    "gemma3": gemma3_from_hf,  # Gemma3ImageProcessor: SigLIP's resize, bilinear by default, no pan-and-scan
    "pixtral": pixtral_from_hf,
    "mistral3": mistral3_from_hf,
    "internvl": internvl_from_hf,
    "glm_ocr": glm4v_from_hf,  # GLM-OCR ships Glm46VImageProcessor: GLM-4.1V's algorithm and defaults
    "paddleocr_vl": paddleocr_vl_from_hf,
    "ernie4_5_vl_moe": ernie4_5_vl_from_hf,
    "hunyuan_vl": hunyuan_vl_from_hf,
    "qwen3_omni_moe": qwen3_vl_from_hf,  # transformers: Qwen2VLImageProcessor; Qwen3-VL's preset
    "llama4": llama4_from_hf,
    "ovis2": ovis2_from_hf,
    "clip": clip_from_hf,  # CLIPImageProcessor; LLaVA-1.5's too (LlavaImageProcessor, or SigLIP's when named)
    "llava": clip_from_hf,
    "llava_next": llava_next_from_hf,
    "llava_onevision": llava_onevision_from_hf,
    "idefics3": idefics3_from_hf,
    "smolvlm": idefics3_from_hf,  # SmolVLMImageProcessor is Idefics3ImageProcessor
}


def get_processor(kind: str, config: Mapping[str, Any] | None = None,
                  video_config: Mapping[str, Any] | None = None, **overrides) -> Any:
    """kind: a key of PROCESSORS (model_type spelling; '-' and case ignored).
    overrides: config fields that win over the dicts, e.g. backend="pil"."""
    key = kind.lower().replace("-", "_").replace(".", "_")
    if key not in PROCESSORS:
        raise ValueError(f"unknown processor kind {kind!r}; expected one of {sorted(PROCESSORS)}")
    return PROCESSORS[key](config, video_config, **overrides)


__all__ = [
    "ImageLoadError", "LoadFailure", "load_image", "load_images",
    "ImagePlan", "ImagePreprocessError", "Preprocessor", "Preprocessed", "Chunk",
    "QwenVLProcessor", "QwenVLProcessorConfig", "KimiProcessor", "KimiProcessorConfig",
    "qwen2_vl_from_hf", "qwen2_5_vl_from_hf", "qwen3_vl_from_hf", "glm4v_from_hf", "kimi_k25_from_hf",
    "Llama4Processor", "llama4_from_hf", "Ovis2Processor", "ovis2_from_hf",
    "PROCESSORS", "get_processor",
    "SiglipProcessor", "SiglipProcessorConfig", "siglip_from_hf", "siglip2_from_hf", "gemma3_from_hf",
    "ClipProcessor", "clip_from_hf", "AnyresProcessor", "llava_next_from_hf", "llava_onevision_from_hf",
    "Idefics3Processor", "idefics3_from_hf", "PixtralProcessor", "pixtral_from_hf", "mistral3_from_hf", "InternVLProcessor", "internvl_from_hf",
]
