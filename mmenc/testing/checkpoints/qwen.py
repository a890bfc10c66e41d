"""Tiny Qwen2-VL, Qwen2.5-VL, Qwen3-VL (dense, MoE), Qwen3-Omni, GLM-4.1V and Kimi-K2.5 checkpoints and
transformers' reference calls on them."""

import torch

from mmenc.testing.checkpoints.base import TINY_TEXT, _TINY_ROPE, _randomise_position_table, _save, _seeded

# Qwen2.5-VL: 4 layers, window 2x2 merged tokens (56 px), layers 1 and 3 full: both kinds run.
TINY_QWEN2_5_VISION = dict(depth=4, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                           patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=56,
                           fullatt_block_indexes=[1, 3], in_channels=3, hidden_act="silu")
TINY_QWEN2_VISION = dict(depth=2, embed_dim=32, num_heads=2, mlp_ratio=2, hidden_size=24, patch_size=14,
                         temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="quick_gelu")


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


# Qwen3-VL: 3 layers, DeepStack after layers 0 and 2, a 6x6 learned position table (resampled up and down).
TINY_QWEN3_VISION = dict(depth=3, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                         patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=36,
                         deepstack_visual_indexes=[0, 2], in_channels=3, hidden_act="gelu_pytorch_tanh")
# GLM-4.1V: a 6x6 position table (image_size / patch_size = 6); out_hidden_size is also the blocks' MLP width.
TINY_GLM4V_VISION = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
                         image_size=84, patch_size=14, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                         hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False)


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


def hf_glm4v_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' GLM-4.1V tower on the same pixels, a (t, h, w) row handed over as t rows of
    (1, h, w) as Glm4vModel.get_video_features does (its tower indexes grid rows by frame)."""
    frames = torch.cat([torch.tensor([[1, h, w]]).repeat(t, 1) for t, h, w in grid_thw.tolist()])
    return hf_tower_outputs(model, pixel_values, frames)


def hf_kimi_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """(hf_kimi_embeddings, []): Kimi-K2.5's embeddings after temporal pooling and the projector."""
    return hf_kimi_embeddings(model, pixel_values, grid_thw), []
