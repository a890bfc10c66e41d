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
}
