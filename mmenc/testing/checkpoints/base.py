"""Shared pieces of the tiny checkpoint writers: the tiny text model, saving, seeding, random pixels."""
import pathlib

import torch

TINY_TEXT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 intermediate_size=48, vocab_size=64, bos_token_id=0, eos_token_id=1, pad_token_id=None)


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


_TINY_ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def _randomise_position_table(model, name: str) -> None:
    """Learned position tables start at std 0.02; make them as large as the patch embedding so a wrong
    interpolation shows."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(name):
                p.normal_()


def _unit_scale(model, parts: tuple[str, ...]) -> None:
    """Matrices (and conv kernels) of the named submodules drawn with std 1/sqrt(fan_in), so every
    layer (attention included) moves the output by O(1) and a wrong rotary or position shows in the
    parity error (transformers' std 0.02 init leaves attention a ~1e-3 contribution in a tiny tower)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and any(part in name for part in parts) and "position_embedding" not in name:
                p.normal_(std=(p[0].numel()) ** -0.5)
