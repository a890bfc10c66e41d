"""Which video processor each family has: transformers' class defaults, read over by the checkpoint's
video processor config, as `AutoVideoProcessor.from_pretrained` does.

    vp = get_video_processor("qwen2_5_vl", video_config)   # a mmenc.preprocess.video.VideoProcessor
    video_kind("qwen3_vl_moe")                              # "qwen3_vl" (None: the family takes no video)

transformers reads a video processor's settings from processor_config.json's "video_processor" entry,
else video_preprocessor_config.json, else preprocessor_config.json (the image processor's file: so a
Qwen2.5-VL checkpoint without a video file resizes its videos under its image pixel bounds);
`video_config_from_files` applies that order to the dicts read from a checkpoint folder.

| kind | transformers class | sampling default | size rule |
|---|---|---|---|
| qwen2_vl, qwen2_5_vl | Qwen2VLVideoProcessor | every frame (do_sample_frames=False) | per frame, 128..768 x 28^2 px |
| qwen3_omni | Qwen2VLVideoProcessor (patch 16, mean/std 0.5), the Omni processor's size 128..768 x 32^2 | every frame | per frame |
| qwen3_vl | Qwen3VLVideoProcessor | 2 fps, 4..768 frames | whole video, 128..768 x 32^2 px |
| glm4v | Glm4vVideoProcessor | 2 fps up to 300 s | whole video, 112^2..2 x 30000 x 28^2 px |
| kimi_k25 | Kimi_K25VideoProcessor | 2 fps | navit, 4096 patches per frame, 4-frame chunks |

Families whose transformers processor has video and mmenc does not do: InternVL (its video frames are
448 px images; not wired yet), ERNIE-4.5-VL (draws each frame's time onto it with a font file from
the Hub, which mmenc cannot fetch and would have to match to the pixel).
"""
import dataclasses
from collections.abc import Mapping
from typing import Any

from mmenc.preprocess.kimi import KimiProcessor, KimiProcessorConfig
from mmenc.preprocess.qwen_vl import GLM4V, HALF, QWEN2_VL, QWEN3_VL, QwenVLProcessor, QwenVLProcessorConfig
from mmenc.preprocess.video import VideoProcessor
from mmenc.preprocess.video_sampling import SamplingDefaults

# model_type (config.json) -> video kind
MODEL_TYPES = {"qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl",
               "qwen3_omni_moe": "qwen3_omni", "glm4v": "glm4v", "glm4v_moe": "glm4v", "kimi_k25": "kimi_k25"}

_QWEN3_OMNI = QwenVLProcessorConfig(patch_size=16, image_mean=HALF, image_std=HALF, video_min_pixels=128 * 32 * 32,
                                    video_max_pixels=768 * 32 * 32)
_PRESETS: dict[str, tuple[QwenVLProcessorConfig | None, SamplingDefaults]] = {
    "qwen2_vl": (QWEN2_VL, SamplingDefaults("qwen2", do_sample_frames=False)),
    "qwen2_5_vl": (QWEN2_VL, SamplingDefaults("qwen2", do_sample_frames=False)),
    "qwen3_omni": (_QWEN3_OMNI, SamplingDefaults("qwen2", do_sample_frames=False)),
    "qwen3_vl": (QWEN3_VL, SamplingDefaults("qwen3", do_sample_frames=True, fps=2.0)),
    "glm4v": (GLM4V, SamplingDefaults("glm4v", do_sample_frames=True, fps=2.0)),
    "kimi_k25": (None, SamplingDefaults("uniform", do_sample_frames=True, fps=2.0, temporal_patch_size=4)),
}
VIDEO_KINDS = tuple(_PRESETS)


def video_kind(model_type: str | None) -> str | None:
    """The video kind of a config.json model_type (or a kind itself); None if mmenc takes no video for it."""
    key = (model_type or "").lower().replace("-", "_")
    return key if key in _PRESETS else MODEL_TYPES.get(key)


def video_config_from_files(processor_config: Mapping[str, Any] | None, video_config: Mapping[str, Any] | None,
                            image_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """transformers' order: processor_config.json["video_processor"], video_preprocessor_config.json,
    preprocessor_config.json (each a dict, or None/{} when the file is absent)."""
    nested = (processor_config or {}).get("video_processor")
    for candidate in (nested, video_config, image_config):
        if candidate:
            return dict(candidate)
    return {}


def _sampling(base: SamplingDefaults, d: Mapping[str, Any], temporal_patch_size: int) -> SamplingDefaults:
    kw: dict[str, Any] = {k: d[k] for k in ("do_sample_frames", "min_frames", "max_frames", "num_frames",
                                            "max_duration") if d.get(k) is not None}
    if d.get("fps") is not None:
        kw["fps"] = float(d["fps"])
    return dataclasses.replace(base, temporal_patch_size=temporal_patch_size, **kw)


def get_video_processor(kind: str, config: Mapping[str, Any] | None = None, **overrides) -> VideoProcessor:
    """kind: a VIDEO_KINDS entry or a config.json model_type; config: the video processor's settings
    (video_config_from_files); overrides: frame-processor config fields that win (e.g. backend="pil")."""
    resolved = video_kind(kind)
    if resolved is None:
        raise ValueError(f"{kind!r} takes no video in mmenc; video families: {', '.join(VIDEO_KINDS)} "
                         f"(model types {', '.join(sorted(MODEL_TYPES))})")
    d = dict(config or {})
    preset, sampling = _PRESETS[resolved]
    if resolved == "kimi_k25":  # the video file's max_patches / temporal_patch_size are the video's
        frames: Any = KimiProcessor(KimiProcessorConfig.from_hf(d, d, **overrides))
    else:
        if resolved == "qwen3_omni":  # Qwen3OmniMoeProcessor calls its video processor with its own size
            overrides = {"video_min_pixels": 128 * 32 * 32, "video_max_pixels": 768 * 32 * 32, **overrides}
        frames = QwenVLProcessor(QwenVLProcessorConfig.from_hf(d, d, defaults=preset, **overrides))
    return VideoProcessor(frames, _sampling(sampling, d, frames.config.temporal_patch_size), resolved)
