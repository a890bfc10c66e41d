"""Tiny Pixtral (Mistral3, Llava) and InternVL checkpoints and transformers' reference calls."""

import torch

from mmenc.testing.checkpoints.base import TINY_TEXT, _save, _seeded

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
