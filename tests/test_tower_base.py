"""The tower base (mmenc.models.base): the generic config reader, the plan cache, the registry's
discovery of families, and tensor parallelism read from the parallel state (no tp_size parameters)."""
import inspect

import pytest
import torch

from mmenc.models.base import VisionTower
from mmenc.models.qwen2_5_vl import Qwen2_5_VisionConfig
from mmenc.models.qwen2_vl import Qwen2VisionConfig, Qwen2VisionTower
from mmenc.models.registry import get_model_spec, supported_architectures

TINY = {"depth": 2, "embed_dim": 32, "hidden_size": 48, "num_heads": 2}


def test_aliases_first_present_wins_and_nulls_are_absent():
    cfg = Qwen2VisionConfig.from_hf({"vision_config": {**TINY, "in_chans": 1, "spatial_patch_size": 16,
                                                       "patch_size": None}})
    assert (cfg.in_channels, cfg.patch_size) == (1, 16)  # aliases; a null patch_size reads as absent
    cfg = Qwen2VisionConfig.from_hf({"vision_config": {**TINY, "in_channels": 2, "in_chans": 1}})
    assert cfg.in_channels == 2  # the field's own name is listed first
    assert Qwen2VisionConfig.from_hf({"vision_config": TINY}).temporal_patch_size == 2  # default


def test_json_values_take_the_field_types():
    cfg = Qwen2_5_VisionConfig.from_hf({**TINY, "hidden_size": 32, "fullatt_block_indexes": [1], "mlp_ratio": 2,
                                        "rope_theta": 500})
    assert cfg.fullatt_block_indexes == (1,) and isinstance(cfg.rope_theta, float)


def test_rope_parameters_win_over_rope_theta():
    v = {**TINY, "rope_theta": 500.0, "rope_parameters": {"rope_type": "default", "rope_theta": 20000}}
    assert Qwen2VisionConfig.from_hf({"vision_config": v}).rope_theta == 20000.0
    assert Qwen2VisionConfig.from_hf({"vision_config": {**TINY, "rope_theta": 500}}).rope_theta == 500.0


def test_a_vision_config_alone_is_read_but_a_full_config_needs_one():
    assert Qwen2VisionConfig.from_hf(TINY).embed_dim == 32
    with pytest.raises(ValueError, match=r"config.json of Qwen2VLForConditionalGeneration has no 'vision_config'"):
        get_model_spec("Qwen2VLForConditionalGeneration").config_from_hf(
            {"architectures": ["Qwen2VLForConditionalGeneration"], "hidden_size": 3584})
    with pytest.raises(ValueError, match="'vision_config' is list; expected a mapping"):
        Qwen2VisionConfig.from_hf({"vision_config": [1, 2]})


def test_validation_still_runs_on_read_values():
    with pytest.raises(ValueError, match=r"Qwen2VisionConfig.depth=0 must be a positive integer"):
        Qwen2VisionConfig.from_hf({**TINY, "depth": 0})


def test_every_family_derives_the_base_and_takes_no_tp_size():
    for arch in supported_architectures():
        cls = get_model_spec(arch).tower_cls
        assert issubclass(cls, VisionTower), f"{arch}: {cls.__name__} does not derive VisionTower"
        assert "tp_size" not in inspect.signature(cls).parameters, f"{arch}: {cls.__name__} takes tp_size"
        config_cls = get_model_spec(arch).config_from_hf.__self__
        assert "from_hf" not in vars(config_cls), f"{arch}: {config_cls.__name__} writes its own from_hf"


def test_plan_is_made_once_per_grid_and_device(monkeypatch):
    tower = Qwen2VisionTower(Qwen2VisionConfig(**TINY))
    calls = []
    make = tower.make_plan
    monkeypatch.setattr(tower, "make_plan", lambda grid, device: calls.append(grid) or make(grid, device))
    grid = torch.tensor([[1, 4, 4], [2, 2, 4]])
    first = tower.plan(grid, "cpu")
    assert tower.plan(grid.clone(), torch.device("cpu")) is first and len(calls) == 1
    assert tower.output_tokens(grid) == [4, 4]
    with pytest.raises(ValueError, match="15 rows but grid_thw describes 32"):
        tower(torch.zeros(15, tower.config.patch_features), grid)


def test_tensor_parallel_size_comes_from_the_parallel_state(monkeypatch):
    """A tower built while a (here: pretend) group of 2 is set holds rank 0's half of every sharded
    layer; built with no group, the whole."""
    whole = Qwen2VisionTower(Qwen2VisionConfig(**TINY), device="meta")
    monkeypatch.setattr("mmenc.layers.linear.get_tp_size", lambda: 2)
    monkeypatch.setattr("mmenc.layers.linear.get_tp_rank", lambda: 0)
    half = Qwen2VisionTower(Qwen2VisionConfig(**TINY), device="meta")
    assert (whole.blocks[0].attn.local_heads, half.blocks[0].attn.local_heads) == (2, 1)
    assert half.blocks[0].mlp.fc1.weight.shape[0] * 2 == whole.blocks[0].mlp.fc1.weight.shape[0]
    assert half.merger.fc2.weight.shape[1] * 2 == whole.merger.fc2.weight.shape[1]
    assert half.patch_embed.proj.weight.shape == whole.patch_embed.proj.weight.shape  # replicated
