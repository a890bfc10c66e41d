"""Tiny SigLIP and SigLIP2 (NaFlex) checkpoints and transformers' reference calls."""

import torch

from mmenc.testing.checkpoints.base import _randomise_position_table, _save, _seeded

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
