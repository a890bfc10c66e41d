"""Qwen3-Omni's vision encoder: what differs from Qwen3-VL (its parity, TP and data mode run in
tests/test_towers_generic.py from its FAMILIES row): checkpoint names, the thinker_config nesting and
its processor (transformers maps qwen3_omni_moe to Qwen2VLImageProcessor)."""
import dataclasses
import importlib.util

import pytest
import torch

from mmenc.models.base import vision_config_dict, vlm_config_dict
from mmenc.models.qwen3_vl import Qwen3OmniVisionTower, Qwen3VisionConfig, Qwen3VisionTower
from mmenc.models.registry import get_model_spec

TINY = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=40, out_hidden_size=24,
            num_position_embeddings=36, deepstack_visual_indexes=[0])


def test_checkpoint_names_map_to_the_qwen3_vl_parameters():
    names = {
        "merger.mlp.0.weight": "merger.fc1.weight",
        "merger.mlp.2.bias": "merger.fc2.bias",
        "merger.ln_q.weight": "merger.ln_q.weight",
        "merger_list.0.mlp.0.weight": "merger_list.0.fc1.weight",
        "blocks.1.mlp.linear_fc1.weight": "blocks.1.mlp.fc1.weight",
        "blocks.1.mlp.linear_fc2.bias": "blocks.1.mlp.fc2.bias",
        "blocks.1.attn.qkv.weight": "blocks.1.attn.qkv.weight",
    }
    tower = Qwen3OmniVisionTower(Qwen3VisionConfig(**TINY), device="meta")
    params = dict(tower.named_parameters())
    for ckpt, param in names.items():
        got, shard = tower.weight_map.to_param(ckpt)
        assert (got, shard) == (param, None), f"{ckpt} -> {got}, expected {param}"
        assert got in params, f"{got} is not a parameter of Qwen3OmniVisionTower"


def test_same_parameters_as_qwen3_vl_under_other_names():
    cfg = Qwen3VisionConfig(**TINY)
    omni = Qwen3OmniVisionTower(cfg, device="meta")
    vl = Qwen3VisionTower(cfg, device="meta")
    rename = {n.replace("deepstack_merger_list.", "merger_list."): tuple(p.shape) for n, p in vl.named_parameters()}
    assert rename == {n: tuple(p.shape) for n, p in omni.named_parameters()}


def test_config_read_under_thinker_config():
    config = {"architectures": ["Qwen3OmniMoeForConditionalGeneration"],
              "thinker_config": {"vision_config": dict(TINY), "text_config": {"hidden_size": 24}}}
    assert vlm_config_dict(config) is config["thinker_config"]
    assert vision_config_dict(config)["depth"] == 2
    assert get_model_spec("Qwen3OmniMoeForConditionalGeneration").config_from_hf(config) == Qwen3VisionConfig(**TINY)
    with pytest.raises(ValueError, match="has no 'vision_config'"):
        vision_config_dict({"architectures": ["X"], "thinker_config": {"text_config": {}}})


def test_processor_matches_transformers_for_omni():
    """The Omni spec's processor against the class transformers maps qwen3_omni_moe to (torchvision
    backend where torchvision is importable, else PIL), on Qwen3-Omni-style settings."""
    transformers = pytest.importorskip("transformers")
    from PIL import Image

    from mmenc.preprocess.qwen_vl import qwen3_vl_from_hf

    backend = "torchvision" if importlib.util.find_spec("torchvision") else "pil"
    names = transformers.models.auto.image_processing_auto.IMAGE_PROCESSOR_MAPPING_NAMES["qwen3_omni_moe"]
    cfg = {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5] * 3,
           "image_std": [0.5] * 3, "min_pixels": 3136, "max_pixels": 300 * 300}
    theirs = getattr(transformers, names[backend])(**cfg)
    spec_processor = get_model_spec("Qwen3OmniMoeForConditionalGeneration").processor_from_hf(cfg)
    ours = qwen3_vl_from_hf(cfg, backend=backend)
    assert dataclasses.replace(spec_processor.config, backend=backend) == ours.config
    g = torch.Generator().manual_seed(0)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), dtype=torch.uint8, generator=g).numpy())
              for h, w in ((90, 130), (257, 61), (400, 380))]
    pixels, grid = ours(images)
    want = theirs(images, return_tensors="pt")
    assert torch.equal(grid, want["image_grid_thw"]), f"grids {grid.tolist()} vs {want['image_grid_thw'].tolist()}"
    level = 1 / 255 / 0.5  # one uint8 level after mean/std 0.5
    diff = (pixels - want["pixel_values"]).abs().max().item()
    assert diff <= level + 1e-6, f"pixels differ by up to {diff:.4f}, more than one uint8 level ({level:.4f})"
