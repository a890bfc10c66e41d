"""Tiny GLM-OCR, PaddleOCR-VL, ERNIE-4.5-VL and HunyuanOCR checkpoints and transformers' reference calls."""

import torch

from mmenc.testing.checkpoints.base import TINY_TEXT, _TINY_ROPE, _randomise_position_table, _save, _seeded, _unit_scale

# GLM-OCR: GLM-4.1V lineage without a position table; q/k norms, biased MLP, merger 3 * out_hidden wide.
TINY_GLM_OCR_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                           hidden_act="silu", rms_norm_eps=1e-5, attention_bias=True)


def save_glm_ocr(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """GlmOcrForConditionalGeneration (ImportError where transformers lacks it)."""
    from transformers import GlmOcrConfig, GlmOcrForConditionalGeneration

    text = dict(TINY_TEXT, rope_parameters=dict(_TINY_ROPE, mrope_section=[2, 3, 3], partial_rotary_factor=0.5))
    config = GlmOcrConfig(vision_config={**TINY_GLM_OCR_VISION, **(vision or {})}, text_config=text, dtype=dtype)
    model = _seeded(GlmOcrForConditionalGeneration, config, seed)
    _unit_scale(model, ("visual.",))
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


# PaddleOCR-VL: a 6x6 learned position table (image_size / patch_size), resampled up and down; the
# projector (pre_norm, linear_1, linear_2) is part of mmenc's tower.
TINY_PADDLEOCR_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                             num_channels=3, image_size=84, patch_size=14, spatial_merge_size=2,
                             hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)


def save_paddleocr_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """PaddleOCRVLForConditionalGeneration (ImportError where transformers lacks it)."""
    from transformers import PaddleOCRVLConfig, PaddleOCRVLForConditionalGeneration

    text = dict(TINY_TEXT, head_dim=16, rope_parameters=dict(_TINY_ROPE, mrope_section=[2, 3, 3]))
    config = PaddleOCRVLConfig(vision_config={**TINY_PADDLEOCR_VISION, **(vision or {})}, text_config=text,
                               dtype=dtype)
    model = _seeded(PaddleOCRVLForConditionalGeneration, config, seed)
    _unit_scale(model, ("visual.", "projector."))
    _randomise_position_table(model, "embeddings.position_embedding.weight")
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_image_features(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(embeddings the language model consumes, []) from transformers' `model.model.get_image_features`:
    tower and projector (PaddleOCR-VL, ERNIE-4.5-VL, HunyuanOCR), per-image splits concatenated."""
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, grid_thw)
    pooled = out.pooler_output if hasattr(out, "pooler_output") else out
    return (torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled), []


# ERNIE-4.5-VL: Qwen2-VL-style tower (QuickGELU, LayerNorm) and its resampler (frame pairs merged).
TINY_ERNIE_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, hidden_act="quick_gelu",
                         in_channels=3, patch_size=14, spatial_merge_size=2, temporal_merge_size=2, rms_norm_eps=1e-6)


def save_ernie4_5_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """Ernie4_5_VLMoeForConditionalGeneration under a one-layer dense text model (ImportError where
    transformers lacks it)."""
    from transformers import Ernie4_5_VLMoeConfig, Ernie4_5_VLMoeForConditionalGeneration

    text = dict(TINY_TEXT, rope_parameters=dict(_TINY_ROPE, mrope_section=[3, 3, 2]), mlp_layer_types=["dense"],
                moe_num_experts=2, moe_k=1, moe_num_shared_experts=1,
                moe_intermediate_size=[16, 8])
    config = Ernie4_5_VLMoeConfig(vision_config={**TINY_ERNIE_VISION, **(vision or {})}, text_config=text,
                                  dtype=dtype)
    model = _seeded(Ernie4_5_VLMoeForConditionalGeneration, config, seed)
    _unit_scale(model, ("vision_tower.", "resampler_model."))
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_ernie_features(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' ERNIE-4.5-VL embeddings per grid row, in order: get_image_features for t == 1,
    get_video_features (frame pairs merged) for t > 1."""
    outs, rows = [], pixel_values.split(grid_thw.prod(-1).tolist())
    with torch.no_grad():
        for part, g in zip(rows, grid_thw.split(1)):
            get = model.model.get_video_features if int(g[0, 0]) > 1 else model.model.get_image_features
            outs.extend(get(part, g).pooler_output)
    return torch.cat(outs), []


# HunyuanOCR: a 6x6 position grid (max_image_size / patch_size) after a class row; merger with newlines.
TINY_HUNYUAN_VISION = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=2,
                           num_channels=3, patch_size=16, spatial_merge_size=2, max_image_size=96,
                           hidden_act="gelu", rms_norm_eps=1e-5, text_hidden_size=32)


def save_hunyuan_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """HunYuanVLForConditionalGeneration (ImportError where transformers lacks it); the merger's
    newline / begin / end vectors random."""
    from transformers import HunYuanVLConfig, HunYuanVLForConditionalGeneration

    config = HunYuanVLConfig(vision_config={**TINY_HUNYUAN_VISION, **(vision or {})},
                             text_config=dict(TINY_TEXT, head_dim=16), dtype=dtype)
    model = _seeded(HunYuanVLForConditionalGeneration, config, seed)
    _unit_scale(model, ("vision_tower.",))
    _randomise_position_table(model, "embeddings.position_embedding.weight")
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_hunyuan_features(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' HunyuanOCR embeddings (get_image_features), a (t, h, w) row as t images (1, h, w)."""
    frames = torch.cat([torch.tensor([[1, h, w]]).repeat(t, 1) for t, h, w in grid_thw.tolist()])
    return hf_image_features(model, pixel_values, frames.to(grid_thw.device))
