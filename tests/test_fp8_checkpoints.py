"""Checkpoints that ship FP8 vision weights (mmenc.loader.fp8): compressed-tensors per-channel and
block-scaled FP8 layouts, built locally from the tiny Qwen2.5-VL checkpoint, load to the dequantized values;
the checkpoint's ignore list is honoured."""
import json
import math
import pathlib

import pytest
import torch

from mmenc.config import MultiModalConfig
from mmenc.engine.quantize import checkpoint_ignore, quantized_linears
from mmenc.loader.fp8 import dequantize, dequantized_tensors
from mmenc.testing.checkpoints.base import random_pixels, rewrite_checkpoint

FP8 = torch.float8_e4m3fn
IGNORED = "visual.merger.mlp.2"  # kept in its own dtype by the checkpoint's ignore list


def _linear_weights(tensors):
    return [n for n, t in tensors.items() if n.startswith("visual.") and n.endswith(".weight") and t.dim() == 2
            and not n.startswith(IGNORED + ".")]


def per_channel(tensors):
    for name in _linear_weights(tensors):
        w = tensors[name].float()
        scale = w.abs().amax(1, keepdim=True) / 448
        tensors[name] = (w / scale).to(FP8)
        tensors[name + "_scale"] = scale.to(torch.bfloat16)  # X.weight_scale
        tensors[name.removesuffix(".weight") + ".input_scale"] = torch.ones(1)  # static: ignored by mmenc
    return tensors


def block_scaled(tensors, block=(16, 16)):
    for name in _linear_weights(tensors):
        w = tensors[name].float()
        out, inp = w.shape
        tiles = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
        padded = torch.zeros(tiles[0] * block[0], tiles[1] * block[1])
        padded[:out, :inp] = w
        amax = padded.reshape(tiles[0], block[0], tiles[1], block[1]).abs().amax((1, 3)).clamp_min(1e-12)
        scale_inv = amax / 448
        full = scale_inv.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
        tensors[name] = (w / full).to(FP8)
        tensors[name + "_scale_inv"] = scale_inv
    return tensors


def write(q25, dest, transform, quantization_config):
    folder = rewrite_checkpoint(q25, dest, transform)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (folder / "config.json").write_text(json.dumps(config))
    for extra in pathlib.Path(q25).glob("*.json"):
        if extra.name != "config.json" and not (folder / extra.name).exists():
            (folder / extra.name).write_text(extra.read_text())
    return folder


COMPRESSED = {"quant_method": "compressed-tensors", "format": "float-quantized",
              "ignore": ["lm_head", IGNORED]}
BLOCK = {"quant_method": "fp8", "weight_block_size": [16, 16], "modules_to_not_convert": [IGNORED]}


@pytest.mark.parametrize("layout,quantization_config", [(per_channel, COMPRESSED), (block_scaled, BLOCK)])
def test_fp8_checkpoint_loads_its_dequantized_values(q25, tmp_path, layout, quantization_config):
    from safetensors.torch import load_file

    from mmenc.engine.tower import build_tower

    fp8_folder = write(q25, tmp_path / "fp8", layout, quantization_config)
    stored = load_file(str(fp8_folder / "model.safetensors"))
    assert stored["visual.blocks.0.attn.qkv.weight"].dtype == FP8
    # the same values written out dequantized, as a plain float32 checkpoint
    plain = dict(dequantized_tensors(stored.items(), quantization_config))
    assert not any(n.endswith(("_scale", "_scale_inv", "input_scale")) for n in plain)
    plain_folder = rewrite_checkpoint(fp8_folder, tmp_path / "plain", lambda _: plain)
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    outs = {}
    for name, folder in (("fp8", fp8_folder), ("plain", plain_folder), ("original", pathlib.Path(q25))):
        loaded = build_tower(str(folder), device="cpu", dtype="float32",
                             multimodal_config=MultiModalConfig(linear_backend="native"))
        pixels = random_pixels(grid, loaded.config.patch_features)
        with torch.inference_mode():
            outs[name] = loaded.tower(pixels, grid).embeddings
        if name == "fp8":
            want = plain["visual.blocks.0.attn.qkv.weight"]
            assert torch.equal(loaded.tower.blocks[0].attn.qkv.weight, want)
    assert torch.equal(outs["fp8"], outs["plain"])
    err = ((outs["fp8"] - outs["original"]).norm() / outs["original"].norm()).item()
    assert 1e-4 < err < 0.1, err  # quantized: near the original, not equal to it


def test_checkpoint_ignore_list_keeps_modules_unquantized(q25):
    from mmenc.engine.tower import build_tower

    loaded = build_tower(q25, device="meta", dtype="bfloat16")
    ignore = checkpoint_ignore({"quantization_config": COMPRESSED})
    targets = quantized_linears(loaded.tower, "fp8-all", ignore, loaded.spec.weight_prefixes)
    assert "merger.fc2" not in targets and "merger.fc1" in targets


def test_fp8_weight_without_scale_is_refused():
    weight = torch.randn(4, 4).to(FP8)
    with pytest.raises(ValueError, match="blocks.0.attn.qkv have no .weight_scale"):
        list(dequantized_tensors([("blocks.0.attn.qkv.weight", weight)], None))
    with pytest.raises(ValueError, match=r"scale of shape \(3,\)"):
        dequantize("w", weight, torch.ones(3), (128, 128))


def test_scale_before_weight_and_per_tensor_scale():
    weight = torch.randn(4, 6).to(FP8)
    got = dict(dequantized_tensors([("a.weight_scale", torch.tensor(0.5)), ("a.weight", weight),
                                    ("a.bias", torch.ones(4))], None))
    assert torch.equal(got["a.weight"], weight.float() * 0.5) and torch.equal(got["a.bias"], torch.ones(4))


def test_fp8_tensors_without_quantization_config_are_refused(q25, tmp_path):
    from mmenc.engine.tower import build_tower

    def without_input_scales(tensors):
        return {n: t for n, t in per_channel(tensors).items() if not n.endswith("input_scale")}
    folder = rewrite_checkpoint(q25, tmp_path / "bare", without_input_scales)  # no quantization_config
    with pytest.raises(ValueError, match="is FP8 but config.json has no quantization_config"):
        build_tower(str(folder), device="cpu", dtype="float32")
