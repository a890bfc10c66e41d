"""Tiny CLIP and LLaVA-1.5 (CLIP or SigLIP tower) checkpoints and transformers' reference calls."""

import torch

from mmenc.testing.checkpoints.base import TINY_TEXT, _randomise_position_table, _save, _seeded, _unit_scale

# CLIP: a 6x6 position table (48 px / patch 8) after the class row, resampled for every other frame size;
# 3 layers so that LLaVA's vision_feature_layer=-2 leaves one unbuilt.
TINY_CLIP_VISION = dict(model_type="clip_vision_model", hidden_size=32, num_attention_heads=2, num_hidden_layers=3,
                        intermediate_size=40, patch_size=8, image_size=48, num_channels=3, hidden_act="quick_gelu",
                        projection_dim=24)
TINY_CLIP_TEXT = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                      vocab_size=64, max_position_embeddings=16, bos_token_id=0, eos_token_id=1, pad_token_id=1,
                      projection_dim=24, hidden_act="quick_gelu")
TINY_LLAVA_SIGLIP_VISION = dict(model_type="siglip_vision_model", hidden_size=32, num_attention_heads=2,
                                num_hidden_layers=3, intermediate_size=40, patch_size=8, image_size=48)


def _randomise_embeddings(model) -> None:
    """Position tables and class tokens at unit scale, matrices at 1/sqrt(fan_in): a wrong
    interpolation, token order or skipped layer shows in the parity error."""
    _unit_scale(model, ("vision",))
    _randomise_position_table(model, "embeddings.position_embedding.weight")
    _randomise_position_table(model, "embeddings.class_embedding")


def save_clip(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, text: dict | None = None):
    """CLIPModel: vision and text towers and both projections, all weights random."""
    import transformers

    config = transformers.CLIPConfig(vision_config={**TINY_CLIP_VISION, **(vision or {})},
                                     text_config={**TINY_CLIP_TEXT, **(text or {})}, projection_dim=24)
    model = _seeded(transformers.CLIPModel, config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def save_llava(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, tower: str = "clip",
               feature_layer=-2, strategy: str = "default"):
    """LlavaForConditionalGeneration (LLaVA-1.5's layout: projector with bias) over a tiny CLIP or
    SigLIP tower and a one-layer Llama."""
    import transformers

    base = TINY_CLIP_VISION if tower == "clip" else TINY_LLAVA_SIGLIP_VISION
    config = transformers.LlavaConfig(vision_config={**base, **(vision or {})},
                                      text_config=dict(TINY_TEXT, model_type="llama"),
                                      vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy,
                                      dtype=torch.float32)
    model = _seeded(transformers.LlavaForConditionalGeneration, config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def save_vipllava(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None):
    """VipLlavaForConditionalGeneration over a tiny CLIP tower, three layers concatenated (0, -2, 1)."""
    import transformers

    config = transformers.VipLlavaConfig(vision_config={**TINY_CLIP_VISION, **(vision or {})},
                                         text_config=dict(TINY_TEXT, model_type="llama"), dtype=torch.float32)
    # transformers 5.24 maps the published spelling vision_feature_layers to vision_feature_layer; 5.17 has only it
    config.vision_feature_layers = [0, -2, 1]
    model = _seeded(transformers.VipLlavaForConditionalGeneration, config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def hf_vipllava_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' VipLlavaModel.get_image_features frame by frame (interpolate_pos_encoding=True), concatenated."""
    with torch.no_grad():
        outs = [model.model.get_image_features(pixel_values=image, interpolate_pos_encoding=True).pooler_output[0]
                for image in frame_images(pixel_values, grid_thw, model.config.vision_config.patch_size)]
    return torch.cat(outs), []


def frame_images(pixel_values: torch.Tensor, grid_thw: torch.Tensor, patch: int) -> list[torch.Tensor]:
    """mmenc's packed (C, p, p) patch rows -> one [1, C, h*p, w*p] image per frame (t frames per grid row)."""
    sizes = [(h, w) for t, h, w in grid_thw.tolist() for _ in range(t)]
    rows = pixel_values.reshape(pixel_values.shape[0], -1, patch, patch)
    return [piece.view(h, w, -1, patch, patch).permute(2, 0, 3, 1, 4).reshape(1, -1, h * patch, w * patch)
            for piece, (h, w) in zip(rows.split([h * w for h, w in sizes]), sizes)]


def clip_vision(model):
    """A transformers CLIPVisionModelWithProjection at the CLIPModel's vision size: the module class whose
    parameters mmenc's CLIP tower holds (tower + visual_projection)."""
    import transformers

    with torch.device("meta"):
        return transformers.CLIPVisionModelWithProjection(model.config.vision_config)


def hf_clip_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' CLIP last_hidden_state, frame by frame with interpolate_pos_encoding=True:
    [frames * (1 + h*w), D]."""
    with torch.no_grad():
        outs = [model.vision_model(pixel_values=image, interpolate_pos_encoding=True).last_hidden_state[0]
                for image in frame_images(pixel_values, grid_thw, model.config.vision_config.patch_size)]
    return torch.cat(outs), []


def hf_clip_pooled(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """transformers' CLIPModel.get_image_features per frame: [frames, projection_dim]."""
    with torch.no_grad():
        return torch.cat([model.get_image_features(pixel_values=image, interpolate_pos_encoding=True).pooler_output
                          for image in frame_images(pixel_values, grid_thw, model.config.vision_config.patch_size)])


def hf_llava_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' LlavaModel.get_image_features (tower, feature layer(s), strategy, projector), frame
    by frame with interpolate_pos_encoding=True, concatenated."""
    config = model.config
    with torch.no_grad():
        outs = [model.model.get_image_features(pixel_values=image, vision_feature_layer=config.vision_feature_layer,
                                               vision_feature_select_strategy=config.vision_feature_select_strategy,
                                               interpolate_pos_encoding=True).pooler_output[0]
                for image in frame_images(pixel_values, grid_thw, config.vision_config.patch_size)]
    return torch.cat(outs), []


def save_tiny_tokenizer(folder, kind: str = "clip", eos_last: bool = False):
    """A tokenizer written beside a tiny checkpoint (nothing downloaded): CLIP's BPE tokenizer over single
    letters (CLIPTokenizer, ids 0 <|startoftext|>, 1 <|endoftext|>, or with eos_last=True the end-of-text
    token last, id 63, as the real vocabulary has it), or for SigLIP a word-level PreTrainedTokenizerFast
    (ids 0 <unk>, 1 <pad>, 2 </s>, then lower-case words). Returns the tokenizer."""
    import string

    import transformers

    if kind == "clip":
        letters = [c for c in string.ascii_lowercase] + [f"{c}</w>" for c in string.ascii_lowercase]
        names = ["<|startoftext|>", *letters, "<|endoftext|>"] if eos_last else \
            ["<|startoftext|>", "<|endoftext|>", *letters]
        vocab = {name: i if not (eos_last and name == "<|endoftext|>") else 63 for i, name in enumerate(names)}
        tokenizer = transformers.CLIPTokenizer(vocab=vocab, merges=[], model_max_length=16)
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = "a photo of the cat dog two on grass red blue car house tree".split()
        vocab = {"<unk>": 0, "<pad>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
        backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Whitespace()
        tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>",
                                                         pad_token="<pad>", eos_token="</s>", model_max_length=16)
    tokenizer.save_pretrained(folder)
    return tokenizer


# LLaVA-NeXT / OneVision: 48 px tiles (6 x 6 patches of 8 px), canvases up to 3 tiles a side; OneVision at
# anyres_max_1 so that a 2 x 2 canvas is shrunk (bilinear) and a 1 x 1 one is not.
TINY_NEXT_PINPOINTS = [[48, 96], [96, 48], [96, 96], [144, 48], [48, 144]]
TINY_ONEVISION_PINPOINTS = [[48 * a, 48 * b] for a in range(1, 4) for b in range(1, 4)]


def save_llava_anyres(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None,
                      onevision: bool = False):
    """LlavaNextForConditionalGeneration over a tiny CLIP tower (layer -2, "default"), or with onevision=True
    LlavaOnevisionForConditionalGeneration over a tiny SigLIP tower (layer -1, "full", anyres_max_1);
    image_newline random."""
    import transformers

    text = dict(TINY_TEXT, model_type="qwen2" if onevision else "llama")
    if onevision:
        config = transformers.LlavaOnevisionConfig(vision_config={**TINY_LLAVA_SIGLIP_VISION, **(vision or {})},
                                                   text_config=text, image_grid_pinpoints=TINY_ONEVISION_PINPOINTS,
                                                   vision_aspect_ratio="anyres_max_1", dtype=torch.float32)
        model = _seeded(transformers.LlavaOnevisionForConditionalGeneration, config, seed)
    else:
        config = transformers.LlavaNextConfig(vision_config={**TINY_CLIP_VISION, **(vision or {})}, text_config=text,
                                              image_grid_pinpoints=TINY_NEXT_PINPOINTS, dtype=torch.float32)
        model = _seeded(transformers.LlavaNextForConditionalGeneration, config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def anyres_grid(sizes, pinpoints, tile_px: int = 48, side: int = 6) -> tuple[tuple[int, ...], ...]:
    """grid_thw rows (1 + canvas tiles, s, s, H, W) of images of `sizes` (h, w), as the anyres processor gives them."""
    from mmenc.anyres import select_best_resolution

    rows = []
    for h, w in sizes:
        ch, cw = select_best_resolution(h, w, pinpoints)
        rows.append((1 + (ch // tile_px) * (cw // tile_px), side, side, h, w))
    return tuple(rows)


def hf_anyres_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' get_image_features of LLaVA-NeXT / OneVision image by image (pixel_values [1, tiles, C, T, T],
    image_sizes [[H, W]]): base tile, unpadded canvas (OneVision shrunk), newlines; images concatenated."""
    config = model.config
    p = config.vision_config.patch_size
    outs, rows = [], pixel_values.reshape(pixel_values.shape[0], -1, p, p)
    kwargs = ({"vision_aspect_ratio": config.vision_aspect_ratio} if hasattr(config, "vision_aspect_ratio") else {})
    with torch.no_grad():
        for image, (t, s, _, h, w) in zip(rows.split((grid_thw[:, :3].prod(-1)).tolist()), grid_thw.tolist()):
            tiles = image.view(t, s, s, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(1, t, -1, s * p, s * p)
            out = model.model.get_image_features(pixel_values=tiles, image_sizes=torch.tensor([[h, w]]),
                                                 vision_feature_layer=config.vision_feature_layer,
                                                 vision_feature_select_strategy=config.vision_feature_select_strategy,
                                                 **kwargs)
            outs.append(out.pooler_output[0])
    return torch.cat(outs), []


# Idefics3 / SmolVLM: a 6x6 position table (48 px tiles of 8 px patches) read by bucketed coordinates; scale 2.
TINY_IDEFICS3_VISION = dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=2, intermediate_size=40,
                            patch_size=8, image_size=48)


def save_idefics3(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None, smolvlm: bool = False):
    """Idefics3ForConditionalGeneration (or SmolVLMForConditionalGeneration) over a tiny tower, scale_factor 2."""
    import transformers

    prefix = "SmolVLM" if smolvlm else "Idefics3"
    config = getattr(transformers, f"{prefix}Config")(vision_config={**TINY_IDEFICS3_VISION, **(vision or {})},
                                                      text_config=dict(TINY_TEXT, model_type="llama"), scale_factor=2,
                                                      image_token_id=63, dtype=torch.float32)
    model = _seeded(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def hf_idefics3_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' get_image_features image by image (its tiles as [1, tiles, C, h*p, w*p], no padding mask),
    concatenated: [tiles * h*w / scale^2, text hidden] per grid row."""
    p = model.config.vision_config.patch_size
    rows, outs = pixel_values.reshape(pixel_values.shape[0], -1, p, p), []
    with torch.no_grad():
        for image, (t, h, w) in zip(rows.split(grid_thw.prod(-1).tolist()), grid_thw.tolist()):
            tiles = image.view(t, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(1, t, -1, h * p, w * p)
            pooled = model.model.get_image_features(pixel_values=tiles).pooler_output
            # transformers 5.24: a list of [tiles * tokens, hidden] per image; 5.17: a [tiles, tokens, hidden] tensor
            outs.append(pooled[0] if isinstance(pooled, (list, tuple)) else pooled.reshape(-1, pooled.shape[-1]))
    return torch.cat(outs), []


def save_aya_vision(folder, vision: dict | None = None, seed: int = 0, max_shard_size=None):
    """AyaVisionForConditionalGeneration over a tiny SigLIP tower (48 px tiles), downsample 2, a one-layer Cohere2."""
    import transformers

    text = dict(model_type="cohere2", hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, intermediate_size=48, vocab_size=64, layer_types=["full_attention"])
    config = transformers.AyaVisionConfig(vision_config={**TINY_LLAVA_SIGLIP_VISION, **(vision or {})},
                                          text_config=text, alignment_intermediate_size=40, image_token_index=63,
                                          dtype=torch.float32)
    model = _seeded(transformers.AyaVisionForConditionalGeneration, config, seed)
    _randomise_embeddings(model)
    return _save(model, folder, max_shard_size), model


def hf_aya_outputs(model, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> tuple[torch.Tensor, list]:
    """transformers' AyaVisionModel.get_image_features tile by tile (square tiles, interpolate_pos_encoding=True)."""
    config = model.config
    with torch.no_grad():
        outs = [model.model.get_image_features(pixel_values=image, vision_feature_layer=config.vision_feature_layer,
                                               vision_feature_select_strategy="full",
                                               interpolate_pos_encoding=True).pooler_output[0]
                for image in frame_images(pixel_values, grid_thw, config.vision_config.patch_size)]
    return torch.cat(outs), []
