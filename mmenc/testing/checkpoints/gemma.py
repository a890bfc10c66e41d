"""Tiny PaliGemma and Gemma 3 checkpoints (SigLIP tower + projector) and transformers' reference call."""

import torch

from mmenc.testing.checkpoints.base import _randomise_position_table, _save, _seeded, _unit_scale

# PaliGemma: a 6x6 position table (48 px / patch 8), resampled for other frame sizes; projection_dim 24.
TINY_PALIGEMMA_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                             patch_size=8, image_size=48, vision_use_head=False)
# Gemma 3: 4x4 patches (32 px / patch 8) pooled 2x2 to mm_tokens_per_image = 4 tokens a frame.
TINY_GEMMA3_VISION = dict(TINY_PALIGEMMA_VISION, image_size=32)
TINY_GEMMA_TEXT = dict(model_type="gemma", hidden_size=24, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=12, intermediate_size=48, vocab_size=300)


def save_gemma_vlm(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, gemma3: bool = False,
                   mm_tokens_per_image: int = 4):
    """PaliGemmaForConditionalGeneration (gemma3=False) or Gemma3ForConditionalGeneration over a tiny SigLIP
    tower and a one-layer Gemma, 24 wide (the projector output differs from the tower's 32)."""
    import transformers

    if gemma3:
        config = transformers.Gemma3Config(
            vision_config={**TINY_GEMMA3_VISION, **(vision or {})},
            text_config={**TINY_GEMMA_TEXT, "model_type": "gemma3_text", "sliding_window": 8},
            mm_tokens_per_image=mm_tokens_per_image, image_token_index=299, boi_token_index=297, eoi_token_index=298,
            dtype=torch.float32)
        model = _seeded(transformers.Gemma3ForConditionalGeneration, config, seed)
    else:
        config = transformers.PaliGemmaConfig(vision_config={**TINY_PALIGEMMA_VISION, **(vision or {})},
                                              text_config=TINY_GEMMA_TEXT, projection_dim=24, image_token_index=299,
                                              dtype=torch.float32)
        model = _seeded(transformers.PaliGemmaForConditionalGeneration, config, seed)
    # the tower's and projector's matrices at unit scale (Gemma 3's projection starts at zeros), the
    # position table too, and Gemma 3's norm offset around 0 (its 1-D init put it around 1)
    _unit_scale(model, ("vision_tower", "multi_modal_projector"))
    _randomise_position_table(model, "embeddings.position_embedding.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mm_soft_emb_norm.weight"):
                p.normal_(std=0.3)
    return _save(model, folder, max_shard_size), model


def hf_gemma_vlm_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' get_image_features(...).pooler_output frame by frame ([1, C, h*p, w*p] images;
    interpolate_pos_encoding=True where a frame is not the table's size, PaliGemma only), concatenated."""
    from mmenc.testing.checkpoints.clip import frame_images

    vision = model.config.vision_config
    side = vision.image_size // vision.patch_size
    outs = []
    with torch.no_grad():
        for image in frame_images(pixel_values, grid_thw, vision.patch_size):
            native = image.shape[-2:] == (side * vision.patch_size,) * 2
            kwargs = {} if native else {"interpolate_pos_encoding": True}
            pooled = model.model.get_image_features(pixel_values=image, **kwargs).pooler_output
            outs.append(pooled.reshape(-1, pooled.shape[-1]))
    return torch.cat(outs), []
