"""Tiny random-weight Hugging Face checkpoints written to a folder, for tower and engine tests.

Each `save_*` builds the full transformers model (vision tower + a one-layer text model) from a
tiny config, seeds its weights, `save_pretrained`s it (real checkpoint naming, optional sharding)
and returns (folder, hf_model): compare mmenc's output with `hf_vision(hf_model)(pixel_values,
grid_thw)`. Nothing is downloaded.
"""
import pathlib

import torch

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


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


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
