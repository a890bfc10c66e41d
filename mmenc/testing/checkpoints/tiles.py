"""Tiny Llama 4 and Ovis2 checkpoints (fixed-size tiles / crops) and transformers' reference calls."""

import torch

from mmenc.testing.checkpoints.base import TINY_TEXT, _randomise_position_table, _save, _seeded

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
