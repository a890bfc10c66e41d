"""Tiny random-weight Hugging Face checkpoints written to a folder, for tests and benchmarks.

Each `save_*` builds the full transformers model (vision tower + a one-layer text model) from a
tiny config, seeds its weights, `save_pretrained`s it (real checkpoint naming, optional sharding)
and returns (folder, hf_model). `FAMILIES` is the one table the generic tower tests read: per
registered architecture, its saver, transformers' reference call and its pixel layout. Nothing is
downloaded; transformers (a test extra) is imported inside the functions that need it.

    from mmenc.testing import checkpoints as ck
    case = ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"]
    folder, hf_model = case.save(tmp_path)
    embeddings, deepstack = case.reference(hf_model, case.pixels(grid_thw), grid_thw)
"""
import dataclasses
import functools
import math
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from mmenc.testing.compare import relative_error  # noqa: F401  (kept importable as ck.relative_error)

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=48, vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=None)

# Qwen2.5-VL: 4 layers, window 2x2 merged tokens (56 px), layers 1 and 3 full: both kinds run.
TINY_QWEN2_5_VISION = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                           fullatt_block_indexes=[1, 3], in_channels=3, hidden_act="silu")
TINY_QWEN2_VISION = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=24, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="quick_gelu")


def _save(model, folder, max_shard_size=None) -> pathlib.Path:
    folder = pathlib.Path(folder)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return folder


def _seeded(model_cls, config, seed: int):
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at ones/zeros; randomise them so the test sees them
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name or "ln_q" in name else 0.0))
    return model


def save_qwen2_5_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(vision_config={**TINY_QWEN2_5_VISION, **(vision or {})},
                              text_config=dict(TINY_TEXT), dtype=dtype)
    model = _seeded(Qwen2_5_VLForConditionalGeneration, config, seed).to(dtype)
    return _save(model, folder, max_shard_size), model


def save_qwen2_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(vision_config={**TINY_QWEN2_VISION, **(vision or {})},
                           text_config=dict(TINY_TEXT), dtype=dtype)
    model = _seeded(Qwen2VLForConditionalGeneration, config, seed).to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_vision(model):
    """The vision tower module of a transformers Qwen-VL model (its attribute moved across versions)."""
    inner = getattr(model, "model", model)
    return getattr(inner, "visual", None) or model.visual


def hf_tower_output(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """The reference embeddings [tokens, out_hidden] from transformers' own tower."""
    with torch.no_grad():
        out = hf_vision(model)(pixel_values, grid_thw=grid_thw)
    return out.pooler_output if hasattr(out, "pooler_output") else out


def random_pixels(grid_thw: torch.Tensor, patch_features: int = 3 * 2 * 14 * 14, seed: int = 0) -> torch.Tensor:
    """pixel_values [sum(t*h*w), patch_features] float32 for grid_thw."""
    g = torch.Generator().manual_seed(seed)
    rows = int((grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).sum())
    return torch.randn(rows, patch_features, generator=g)


def rewrite_checkpoint(src, dest, transform) -> pathlib.Path:
    """Copy checkpoint `src` to `dest` as one model.safetensors whose tensors are `transform(dict)`
    (a dict name -> tensor, edited or returned anew); config.json is copied unchanged."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dest = pathlib.Path(src), pathlib.Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    tensors = transform(tensors) or tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", dest / "config.json")
    return dest


# Qwen3-VL: 3 layers, DeepStack after layers 0 and 2, a 6x6 learned position table (resampled up and down).
TINY_QWEN3_VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                         patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36,
                         deepstack_visual_indexes=[0, 2], in_channels=3, hidden_act="gelu_pytorch_tanh")
# GLM-4.1V: a 6x6 position table (image_size / patch_size = 6); out_hidden_size is also the blocks' MLP width.
TINY_GLM4V_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                         image_size=84, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                         hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False)
_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _randomise_position_table(model, name: str) -> None:
    """Learned position tables start at std 0.02; make them as large as the patch embedding so a wrong
    interpolation shows."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(name):
                p.normal_()


def save_qwen3_vl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32,
                  moe: bool = False):
    """Qwen3VLForConditionalGeneration, or with moe=True Qwen3VLMoeForConditionalGeneration (same tower)."""
    import transformers

    text = dict(TINY_TEXT, head_dim=16, rope_parameters=dict(_TINY_ROPE, mrope_section=[2, 3, 3]))
    if moe:
        text.update(num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16)
    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{prefix}Config")(vision_config={**TINY_QWEN3_VISION, **(vision or {})},
                                                      text_config=text, dtype=dtype)
    model = _seeded(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, seed)
    _randomise_position_table(model, "visual.pos_embed.weight")
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def save_glm4v(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32,
               moe: bool = False):
    """Glm4vForConditionalGeneration, or with moe=True Glm4vMoeForConditionalGeneration (same tower)."""
    import transformers

    text = dict(TINY_TEXT, rope_parameters=dict(_TINY_ROPE, mrope_section=[2, 3, 3], partial_rotary_factor=0.5))
    if moe:
        text.update(head_dim=16, n_routed_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                    n_shared_experts=1, first_k_dense_replace=1)
    prefix = "Glm4vMoe" if moe else "Glm4v"
    config = getattr(transformers, f"{prefix}Config")(vision_config={**TINY_GLM4V_VISION, **(vision or {})},
                                                      text_config=text, dtype=dtype)
    model = _seeded(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, seed)
    _randomise_position_table(model, "visual.embeddings.position_embedding.weight")
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def _unit_scale(model, parts: tuple[str, ...]) -> None:
    """Matrices (and conv kernels) of the named submodules drawn with std 1/sqrt(fan_in), so every
    layer (attention included) moves the output by O(1) and a wrong rotary or position shows in the
    parity error (transformers' std 0.02 init leaves attention a ~1e-3 contribution in a tiny tower)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and any(part in name for part in parts) and "position_embedding" not in name:
                p.normal_(std=(p[0].numel()) ** -0.5)


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


def hf_tower_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(embeddings [tokens, out_hidden], deepstack features list or []) from transformers' own tower;
    older transformers returned Qwen3-VL's as a tuple (embeddings, deepstack list)."""
    with torch.no_grad():
        out = hf_vision(model)(pixel_values, grid_thw=grid_thw)
    if isinstance(out, tuple):
        return out[0], list(out[1]) if len(out) > 1 else []
    return out.pooler_output, list(getattr(out, "deepstack_features", None) or [])


# Qwen3-Omni: Qwen3-VL's tiny tower under a thinker (tiny MoE text model and audio encoder; no talker).
TINY_OMNI_AUDIO = dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=16, d_model=16,
                       output_dim=32, n_window=4, n_window_infer=8, downsample_hidden_size=8)


def save_qwen3_omni(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """Qwen3OmniMoeForConditionalGeneration without audio output; its tower saves as thinker.visual.*."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    text = dict(TINY_TEXT, head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                rope_parameters=dict(_TINY_ROPE, mrope_section=[2, 3, 3]))
    thinker = dict(vision_config={**TINY_QWEN3_VISION, **(vision or {})}, text_config=text,
                   audio_config=dict(TINY_OMNI_AUDIO))
    config = Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False, dtype=dtype)
    model = _seeded(Qwen3OmniMoeForConditionalGeneration, config, seed)
    _randomise_position_table(model, "visual.pos_embed.weight")
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_omni_vision(model):
    """transformers' Qwen3-Omni vision encoder (thinker.model.visual; thinker.visual in older versions)."""
    thinker = model.thinker
    return getattr(getattr(thinker, "model", thinker), "visual", None) or thinker.visual


def hf_omni_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(embeddings, deepstack features) of transformers' Qwen3-Omni vision encoder."""
    with torch.no_grad():
        out = hf_omni_vision(model)(pixel_values, grid_thw=grid_thw)
    return out.pooler_output, list(out.deepstack_features)


# Llama 4: 56 px tiles of 14 px patches (4 x 4 patches, 2 x 2 tokens after the pixel shuffle), 2 layers.
TINY_LLAMA4_VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=128,
                          image_size=56, patch_size=14, projector_input_dim=24, projector_output_dim=24,
                          vision_output_dim=24, pixel_shuffle_ratio=0.5)
TINY_LLAMA4_TEXT = dict(TINY_TEXT, head_dim=16, intermediate_size_mlp=48, num_local_experts=2, num_experts_per_tok=1)


def save_llama4(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """Llama4ForConditionalGeneration; the tower saves as vision_model.*, its projector as
    multi_modal_projector.linear_1. Learned position table and CLS token made as large as the patches."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    config = Llama4Config(vision_config={**TINY_LLAMA4_VISION, **(vision or {})}, text_config=dict(TINY_LLAMA4_TEXT),
                          dtype=dtype)
    model = _seeded(Llama4ForConditionalGeneration, config, seed)
    _randomise_position_table(model, "positional_embedding_vlm")
    _randomise_position_table(model, "class_embedding")
    with torch.no_grad():  # sharper attention than the init gives, so a wrong rotary or mask shows
        for name, p in model.named_parameters():
            if "vision_model" in name and ("q_proj.weight" in name or "k_proj.weight" in name):
                p.mul_(8)
    if dtype != torch.float32:  # Module.to(dtype) would also cast the complex rotary buffer to real
        model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def square_tiles(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """mmenc's fixed-size rows [T, C, p, p] (Llama 4 tiles', Ovis2 crops' patches, each in raster order) ->
    transformers' images [tiles, C, s*p, s*p]."""
    tiles, s = int(grid_thw[:, 0].sum()), int(grid_thw[0, 1])
    c, p = pixel_values.shape[1], pixel_values.shape[-1]
    x = pixel_values.reshape(tiles, s, s, c, p, p).permute(0, 3, 1, 4, 2, 5)  # tiles, C, s, p, s, p
    return x.reshape(tiles, c, s * p, s * p)


def hf_llama4_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' Llama 4 image embeddings as its language model receives them: vision_model, then
    multi_modal_projector, [tiles * tokens per tile, text hidden]."""
    with torch.no_grad():
        inner = getattr(model, "model", model)
        out = inner.vision_model(square_tiles(pixel_values, grid_thw))
        features = out.last_hidden_state
        return inner.multi_modal_projector(features.reshape(-1, features.shape[-1])), []


# Ovis2: 56 px crops (4 x 4 patches, hidden stride 2: 2 x 2 tokens each), a 40-entry visual vocabulary.
TINY_OVIS2_VISION = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=40,
                         image_size=56, patch_size=14, hidden_stride=2, vocab_size=40, num_visual_indicator_tokens=5,
                         qkv_bias=True)


def save_ovis2(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, dtype=torch.float32):
    """Ovis2ForConditionalGeneration (qkv bias on, so that path loads too); the tower saves as
    model.vision_tower.*, the visual embedding table as model.visual_embeddings_table."""
    from transformers import Ovis2Config, Ovis2ForConditionalGeneration

    text = dict(TINY_TEXT, hidden_size=24)
    config = Ovis2Config(vision_config={**TINY_OVIS2_VISION, **(vision or {})}, text_config=text, hidden_size=24,
                         dtype=dtype)
    model = _seeded(Ovis2ForConditionalGeneration, config, seed)
    _randomise_position_table(model, "position_embedding.weight")
    with torch.no_grad():  # a sharper softmax over the visual vocabulary than the init gives
        model.model.vision_tower.head_linear.weight.mul_(20)
    model = model.to(dtype)
    return _save(model, folder, max_shard_size), model


def hf_ovis2_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' Ovis2 image features (tower, visual tokenizer, embedding table), [crops * tokens, hidden]."""
    with torch.no_grad():
        out = model.model.get_image_features(square_tiles(pixel_values, grid_thw)).pooler_output
    return out.reshape(-1, out.shape[-1]), []


# Kimi-K2.5: MoonViT with a 6x6 learned position grid (grids below, at and above it resample it), up to
# 4 frames per video chunk, under a tiny DeepSeek-V3 text model.
TINY_KIMI_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                        patch_size=14, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4)
TINY_DEEPSEEK_TEXT = dict(model_type="deepseek_v3", hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=2, intermediate_size=32, moe_intermediate_size=8, n_routed_experts=2,
                          num_experts_per_tok=1, n_shared_experts=1, first_k_dense_replace=1, vocab_size=64,
                          kv_lora_rank=8, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                          n_group=1, topk_group=1)


def save_kimi_k25(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None):
    """Kimi_K25ForConditionalGeneration (ImportError where transformers lacks it), tower and projector
    weights all random (norm weights around 1). save_pretrained writes the published names
    (vision_tower.encoder.blocks.N.wqkv, mm_projector.proj.0, ...)."""
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    vision = {**TINY_KIMI_VISION, **(vision or {})}
    config = Kimi_K25Config(vision_config=vision, text_config=dict(TINY_DEEPSEEK_TEXT),
                            projection_hidden_size=vision["hidden_size"], dtype=torch.float32)
    torch.manual_seed(seed)
    model = Kimi_K25ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "vision_tower" in name or "mm_projector" in name:
                norm = p.dim() == 1 and "norm" in name and name.endswith("weight")
                p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 1 else 0.2) + (1.0 if norm else 0.0))
    return _save(model, folder, max_shard_size), model


def hf_kimi_embeddings(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' Kimi-K2.5 embeddings the language model consumes: get_image_features (tower,
    temporal pooling, mm_projector), grid rows concatenated: [sum(h*w) / 4, text hidden]."""
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values, grid_thw)
    return torch.cat(list(out.pooler_output))


# SigLIP: a 6x6 position table (48 px / patch 8), resampled for every other frame size; the pooling head.
TINY_SIGLIP_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                          patch_size=8, image_size=48, num_channels=3, vision_use_head=True)
# SigLIP2 (NaFlex): a 6x6 position table (num_patches 36) resampled per image with antialiased bilinear.
TINY_SIGLIP2_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                           patch_size=4, num_patches=36, num_channels=3, vision_use_head=True)
TINY_SIGLIP_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=48,
                        vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1)


def save_siglip(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, version: int = 1):
    """SiglipModel (version=1) or Siglip2Model (version=2): vision and text towers, all weights random
    (LayerNorm weights around 1, the position table and the pooling probe at unit scale)."""
    import transformers

    prefix = "Siglip2" if version == 2 else "Siglip"
    tiny = TINY_SIGLIP2_VISION if version == 2 else TINY_SIGLIP_VISION
    config = getattr(transformers, f"{prefix}Config")(vision_config={**tiny, **(vision or {})},
                                                      text_config=dict(TINY_SIGLIP_TEXT))
    model = _seeded(getattr(transformers, f"{prefix}Model"), config, seed)
    _randomise_position_table(model, "vision_model.embeddings.position_embedding.weight")
    _randomise_position_table(model, "vision_model.head.probe")
    return _save(model, folder, max_shard_size), model


def siglip_vision(model):
    """transformers' SigLIP(2) vision transformer of a SiglipModel / Siglip2Model."""
    return model.vision_model


def siglip_frames(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[tuple[torch.Tensor, int, int]]:
    """mmenc's packed pixel_values [T, F] -> (patches [h*w, F], h, w) per frame (t frames per grid row)."""
    sizes = [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]
    pieces = pixel_values.reshape(pixel_values.shape[0], -1).split([h * w for h, w in sizes])
    return [(piece, h, w) for piece, (h, w) in zip(pieces, sizes)]


def hf_siglip_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' SigLIP last_hidden_state, frame by frame as [1, C, h*p, w*p] images with
    interpolate_pos_encoding=True, concatenated: [T, hidden]."""
    p = model.config.vision_config.patch_size
    outs = []
    with torch.no_grad():
        for patches, h, w in siglip_frames(pixel_values, grid_thw):
            image = patches.view(h, w, -1, p, p).permute(2, 0, 3, 1, 4).reshape(1, -1, h * p, w * p)
            outs.append(model.vision_model(pixel_values=image, interpolate_pos_encoding=True).last_hidden_state[0])
    return torch.cat(outs), []


def hf_siglip2_batch(pixel_values: torch.Tensor, grid_thw: torch.Tensor):
    """mmenc's packed NaFlex pixels -> transformers' padded batch: (pixel_values [N, L, F],
    pixel_attention_mask [N, L], spatial_shapes [N, 2]), L the longest frame."""
    frames = siglip_frames(pixel_values, grid_thw)
    longest = max(patches.shape[0] for patches, _, _ in frames)
    padded = pixel_values.new_zeros(len(frames), longest, frames[0][0].shape[-1])
    mask = torch.zeros(len(frames), longest, dtype=torch.int32)
    for i, (patches, _, _) in enumerate(frames):
        padded[i, :patches.shape[0]], mask[i, :patches.shape[0]] = patches, 1
    return padded, mask.to(padded.device), torch.tensor([[h, w] for _, h, w in frames], device=padded.device)


def hf_siglip2_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' SigLIP2 last_hidden_state on the padded batch, its valid tokens packed: [T, hidden]."""
    padded, mask, shapes = hf_siglip2_batch(pixel_values, grid_thw)
    with torch.no_grad():
        out = model.vision_model(pixel_values=padded, pixel_attention_mask=mask, spatial_shapes=shapes)
    return out.last_hidden_state[mask.bool()], []


# Pixtral: 2 layers under Mistral3's projector (2x2 patch merger) or Llava's; positions up to 16 per side.
TINY_PIXTRAL_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                           patch_size=14, image_size=14 * 16, hidden_act="silu", head_dim=16)
TINY_MISTRAL_TEXT = dict(model_type="mistral", hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=48, vocab_size=64, rms_norm_eps=1e-5)


def save_pixtral(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, llava: bool = False):
    """Mistral3ForConditionalGeneration, or with llava=True LlavaForConditionalGeneration (Pixtral-12B's
    layout: no merger, projector with bias, every token kept), with a tiny pixtral tower."""
    import transformers

    vision = {"model_type": "pixtral", **TINY_PIXTRAL_VISION, **(vision or {})}
    if llava:
        config = transformers.LlavaConfig(vision_config=vision, text_config=dict(TINY_MISTRAL_TEXT),
                                          vision_feature_select_strategy="full", vision_feature_layer=-1,
                                          dtype=torch.float32)
        model = _seeded(transformers.LlavaForConditionalGeneration, config, seed)
    else:
        config = transformers.Mistral3Config(vision_config=vision, text_config=dict(TINY_MISTRAL_TEXT),
                                             multimodal_projector_bias=True, dtype=torch.float32)
        model = _seeded(transformers.Mistral3ForConditionalGeneration, config, seed)
    return _save(model, folder, max_shard_size), model


def pixtral_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch: int):
    """mmenc's Pixtral input (patch rows [T, C, p, p] in raster order; a (t, h, w) row is t images) ->
    transformers' (images [N, C, Hmax, Wmax] zero-padded bottom/right, image_sizes [(H, W)])."""
    frames = [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]
    rows = pixel_values.reshape(pixel_values.shape[0], -1, patch, patch)
    images = rows.new_zeros(len(frames), rows.shape[1], max(h for h, _ in frames) * patch,
                            max(w for _, w in frames) * patch)
    for i, (patches, (h, w)) in enumerate(zip(rows.split([h * w for h, w in frames]), frames)):
        images[i, :, :h * patch, :w * patch] = patches.view(h, w, -1, patch, patch).permute(2, 0, 3, 1, 4).reshape(
            -1, h * patch, w * patch)
    return images, [(h * patch, w * patch) for h, w in frames]


def hf_pixtral_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' Pixtral embeddings (get_image_features: tower + projector) on the same pixels,
    padded into one batch with image_sizes as PixtralImageProcessor gives them; images concatenated."""
    images, sizes = pixtral_images(pixel_values, grid_thw, model.config.vision_config.patch_size)
    with torch.no_grad():
        out = model.model.get_image_features(pixel_values=images, image_sizes=torch.tensor(sizes))
    feats = out.pooler_output if hasattr(out, "pooler_output") else out
    return (torch.cat(list(feats)) if isinstance(feats, (list, tuple)) else feats.reshape(-1, feats.shape[-1])), []


# InternViT: 2 layers, a 6x6 learned position grid (84 px tiles; other tile sizes resample it), layer
# scales, under InternVL's projector (pixel shuffle 0.5) and a tiny Qwen2 text model.
TINY_INTERNVL_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                            image_size=[84, 84], patch_size=[14, 14], attention_bias=True, use_qk_norm=False,
                            norm_type="layer_norm", use_mean_pooling=True)


def save_internvl(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None):
    """InternVLForConditionalGeneration with a tiny InternViT; the CLS token and position table (zeros
    at init) and the layer scales are random too."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    config = InternVLConfig(vision_config={**TINY_INTERNVL_VISION, **(vision or {})},
                            text_config=dict(TINY_TEXT, model_type="qwen2"), dtype=torch.float32)
    model = _seeded(InternVLForConditionalGeneration, config, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("cls_token", "position_embeddings")):
                p.normal_()
    return _save(model, folder, max_shard_size), model


def hf_internvl_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' InternVL embeddings on the same pixels, tile by tile: its vision tower, the CLS
    token dropped, its pixel_shuffle on the (h, w) patch grid, its projector (get_image_features
    itself assumes square tiles; these are its steps for any h x w)."""
    inner, patch = model.model, model.config.vision_config.patch_size
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    frames = [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]
    rows = pixel_values.reshape(pixel_values.shape[0], -1, patch, patch).split([h * w for h, w in frames])
    out = []
    with torch.no_grad():
        for patches, (h, w) in zip(rows, frames):
            image = patches.view(h, w, -1, patch, patch).permute(2, 0, 3, 1, 4).reshape(1, -1, h * patch, w * patch)
            feats = inner.vision_tower(pixel_values=image).last_hidden_state[:, 1:]  # [1, h*w, D]
            feats = inner.pixel_shuffle(feats.reshape(1, h, w, -1), scale_factor=model.config.downsample_ratio)
            out.append(inner.multi_modal_projector(feats.reshape(-1, feats.shape[-1])))
    return torch.cat(out), []


# ---- the table the generic tower tests read: one row per tower family ----

def hf_glm4v_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' GLM-4.1V tower on the same pixels, a (t, h, w) row handed over as t rows of
    (1, h, w) as Glm4vModel.get_video_features does (its tower indexes grid rows by frame)."""
    frames = torch.cat([torch.tensor([[1, h, w]]).repeat(t, 1) for t, h, w in grid_thw.tolist()])
    return hf_tower_outputs(model, pixel_values, frames)


def hf_kimi_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(hf_kimi_embeddings, []): Kimi-K2.5's embeddings after temporal pooling and the projector."""
    return hf_kimi_embeddings(model, pixel_values, grid_thw), []


@dataclasses.dataclass(frozen=True)
class FamilyCase:
    """What the generic tower tests need to know about one checkpoint architecture.

    save: (folder) -> (folder, transformers model), a tiny random checkpoint written there.
    reference: (hf_model, pixel_values, grid_thw) -> (embeddings [tokens, out_hidden], extra feature
        list, e.g. Qwen3-VL's deepstack [tokens, out_hidden] each, or []) from transformers.
    patch_shape: one row of pixel_values as the model's processor gives it, e.g. (1176,) or (3, 14, 14).
    aliases: architectures served by the same tower that transformers cannot write (built-ins only).
    builtin_prefix: every built-in name of this row's architectures starts with it.
    hf_tower: hf_model -> the transformers module holding exactly the parameters of mmenc's tower
        (built again at the built-ins' sizes on the meta device to compare parameter counts),
        or None where no transformers module does (MoonViT: tower and projector live apart).
    grid: the grid_thw rows the generic tests run (None: their mixed-size GRID); fixed-size towers
        give rows of their tile size, e.g. Llama 4's (tiles, s, s).
    meta_grid: grid_thw rows for the built-in sizes on the meta device (None: [[1, 4, 4], [1, 4, 6]]).
    """

    save: Callable[..., tuple[pathlib.Path, Any]]
    reference: Callable[[Any, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list]]
    patch_shape: tuple[int, ...]
    builtin_prefix: str
    aliases: tuple[str, ...] = ()
    hf_tower: Callable[[Any], Any] | None = hf_vision
    grid: tuple[tuple[int, int, int], ...] | None = None
    meta_grid: tuple[tuple[int, int, int], ...] | None = None

    @property
    def patch_features(self) -> int:
        return math.prod(self.patch_shape)

    def pixels(self, grid_thw: torch.Tensor, seed: int = 0) -> torch.Tensor:
        """Random pixel_values [sum(t*h*w), *patch_shape] float32 for grid_thw."""
        return random_pixels(grid_thw, self.patch_features, seed=seed).view(-1, *self.patch_shape)


def hf_tower_parameters(case: FamilyCase, hf_model, hf_config: dict) -> int:
    """Parameters of transformers' tower (case.hf_tower's class) built on the meta device from
    `hf_config`'s vision_config (a full config.json dict, e.g. a built-in one)."""
    from mmenc.models.base import vision_config_dict

    tower = case.hf_tower(hf_model)
    tower_cls = type(tower)
    vision_config = type(tower.config)(**vision_config_dict(hf_config))
    with torch.device("meta"):
        return sum(p.numel() for p in tower_cls(vision_config).parameters())


_QWEN_PIXELS = (3 * 2 * 14 * 14,)
FAMILIES: dict[str, FamilyCase] = {
    "Qwen2VLForConditionalGeneration": FamilyCase(save_qwen2_vl, hf_tower_outputs, _QWEN_PIXELS, "Qwen/Qwen2-VL-"),
    "Qwen2_5_VLForConditionalGeneration": FamilyCase(save_qwen2_5_vl, hf_tower_outputs, _QWEN_PIXELS,
                                                     "Qwen/Qwen2.5-VL-"),
    "Qwen3VLForConditionalGeneration": FamilyCase(save_qwen3_vl, hf_tower_outputs, (3 * 2 * 16 * 16,),
                                                  "Qwen/Qwen3-VL-"),
    "Qwen3VLMoeForConditionalGeneration": FamilyCase(functools.partial(save_qwen3_vl, moe=True), hf_tower_outputs,
                                                     (3 * 2 * 16 * 16,), "Qwen/Qwen3-VL-"),
    "Glm4vForConditionalGeneration": FamilyCase(save_glm4v, hf_glm4v_outputs, _QWEN_PIXELS, "zai-org/GLM-4"),
    # qkv bias on here, so that path loads and runs too
    "Glm4vMoeForConditionalGeneration": FamilyCase(functools.partial(save_glm4v, moe=True,
                                                                     vision=dict(attention_bias=True)),
                                                   hf_glm4v_outputs, _QWEN_PIXELS, "zai-org/GLM-4"),
    "GlmOcrForConditionalGeneration": FamilyCase(save_glm_ocr, hf_tower_outputs, _QWEN_PIXELS, "zai-org/GLM-OCR"),
    "PaddleOCRVLForConditionalGeneration": FamilyCase(save_paddleocr_vl, hf_image_features, (3, 14, 14),
                                                      "PaddlePaddle/PaddleOCR-VL", hf_tower=None),
    "Ernie4_5_VLMoeForConditionalGeneration": FamilyCase(
        save_ernie4_5_vl, hf_ernie_features, (3 * 14 * 14,), "baidu/ERNIE-4.5-VL-",
        aliases=("Ernie4_5_VL_MoeForConditionalGeneration",), hf_tower=None),
    "HunYuanVLForConditionalGeneration": FamilyCase(save_hunyuan_vl, hf_hunyuan_features, (3 * 16 * 16,),
                                                    "tencent/HunyuanOCR", hf_tower=None),
    "Qwen3OmniMoeForConditionalGeneration": FamilyCase(save_qwen3_omni, hf_omni_outputs, (3 * 2 * 16 * 16,),
                                                       "Qwen/Qwen3-Omni-", hf_tower=hf_omni_vision),
    "Llama4ForConditionalGeneration": FamilyCase(save_llama4, hf_llama4_outputs, (3, 14, 14), "meta-llama/Llama-4-",
                                                 hf_tower=None, grid=((1, 4, 4), (3, 4, 4), (2, 4, 4), (1, 4, 4)),
                                                 meta_grid=((1, 24, 24), (2, 24, 24))),
    "Ovis2ForConditionalGeneration": FamilyCase(save_ovis2, hf_ovis2_outputs, (3, 14, 14), "thisisiron/Ovis2-",
                                                hf_tower=None,  # ours also holds the visual embedding table
                                                grid=((2, 4, 4), (1, 4, 4), (3, 4, 4), (1, 4, 4)),
                                                meta_grid=((1, 32, 32), (3, 32, 32))),
    "Kimi_K25ForConditionalGeneration": FamilyCase(save_kimi_k25, hf_kimi_outputs, (3, 14, 14), "moonshotai/Kimi-",
                                                   aliases=("KimiK25ForConditionalGeneration",
                                                            "KimiVLForConditionalGeneration"), hf_tower=None),
    "SiglipModel": FamilyCase(save_siglip, hf_siglip_outputs, (3 * 8 * 8,), "google/siglip-",
                              aliases=("SiglipVisionModel", "PaliGemmaForConditionalGeneration",
                                       "Gemma3ForConditionalGeneration"), hf_tower=siglip_vision),
    "Siglip2Model": FamilyCase(functools.partial(save_siglip, version=2), hf_siglip2_outputs, (4 * 4 * 3,),
                               "google/siglip2-", aliases=("Siglip2VisionModel",), hf_tower=siglip_vision),
    "Mistral3ForConditionalGeneration": FamilyCase(save_pixtral, hf_pixtral_outputs, (3, 14, 14),
                                                   "mistralai/Mistral-Small-", hf_tower=None),
    "LlavaForConditionalGeneration": FamilyCase(functools.partial(save_pixtral, llava=True,
                                                                  vision=dict(patch_size=16, image_size=16 * 16)),
                                                hf_pixtral_outputs, (3, 16, 16), "mistralai/Pixtral-", hf_tower=None),
    "InternVLForConditionalGeneration": FamilyCase(save_internvl, hf_internvl_outputs, (3, 14, 14), "OpenGVLab/InternVL",
                                                   hf_tower=None),
}
