"""Qwen2-VL and Qwen2.5-VL towers against transformers' own, through mmenc's loader (fp32, CPU)."""
import json
import pathlib
import re

import pytest
import torch

from checkpoints import hf_tower_output, random_pixels, relative_error, save_qwen2_5_vl, save_qwen2_vl
from mmenc.engine.runner import build_tower, run_tower
from mmenc.layers.grid import frame_lengths
from mmenc.models.qwen2_5_vl import Qwen2_5_VisionConfig, window_order
from mmenc.models.qwen2_vl import Qwen2VisionConfig
from mmenc.models.registry import get_builtin_config, supported_architectures

pytest.importorskip("transformers")

TOL = 1e-5

# (t, h, w) in patches. Merged grid = h/2 x w/2; the tiny Qwen2.5 window is 2x2 merged tokens, so
# odd merged sides give uneven edge windows.
GRIDS = {
    "mixed": [[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 10, 4]],  # smallest, non-square, video, tall
    "video": [[3, 6, 6]],
    "square": [[1, 8, 8]],  # windows fit exactly
    "smallest": [[1, 2, 2]],
    "wide_then_video": [[1, 2, 14], [2, 4, 4], [1, 6, 2]],
}


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory):
    folder, model = save_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    return build_tower(str(folder), device="cpu"), model


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    folder, model = save_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl"))
    return build_tower(str(folder), device="cpu"), model


def _check_parity(loaded, hf_model, grid):
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixels = random_pixels(grid_thw, loaded.config.patch_features)
    ref = hf_tower_output(hf_model, pixels, grid_thw)
    out = run_tower(loaded, pixels, grid_thw).embeddings
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = relative_error(out, ref)
    print(f"{loaded.spec.architectures[0]} grid={grid}: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert err < TOL, f"relative error {err:.2e} exceeds tolerance {TOL:.0e} for grid {grid}"
    assert sum(loaded.output_tokens(grid_thw)) == out.shape[0]
    return out


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_qwen2_5_vl_matches_transformers(qwen2_5, case):
    loaded, hf_model = qwen2_5
    assert loaded.dtype == torch.float32 and loaded.load_format == "auto"
    _check_parity(loaded, hf_model, GRIDS[case])


@pytest.mark.parametrize("case", ["mixed", "video", "smallest"])
def test_qwen2_vl_matches_transformers(qwen2, case):
    loaded, hf_model = qwen2
    _check_parity(loaded, hf_model, GRIDS[case])


def test_qwen2_5_runs_window_and_full_layers_with_uneven_windows(qwen2_5):
    loaded, _ = qwen2_5
    tower, config = loaded.tower, loaded.config
    assert 0 < len(tower.full_attention) < config.depth  # both kinds of layer run
    plan = tower.plan(torch.tensor(GRIDS["mixed"]), "cpu")
    windows = torch.diff(plan.cu_window_seqlens).tolist()
    frames = torch.diff(plan.cu_seqlens).tolist()
    assert frames == frame_lengths(tuple(map(tuple, GRIDS["mixed"])))
    assert len(set(windows)) > 1 and len(windows) > len(frames)  # uneven windows, more than frames
    assert sum(windows) == sum(frames)


def test_batch_equals_images_one_by_one(qwen2_5):
    loaded, _ = qwen2_5
    grid = torch.tensor(GRIDS["mixed"])
    pixels = random_pixels(grid, loaded.config.patch_features, seed=3)
    together = run_tower(loaded, pixels, grid).embeddings
    parts, start = [], 0
    for row in grid:
        n = int(row.prod())
        parts.append(run_tower(loaded, pixels[start:start + n], row[None]).embeddings)
        start += n
    assert relative_error(together, torch.cat(parts)) < TOL


def test_plan_is_cached_per_grid(qwen2_5):
    tower = qwen2_5[0].tower
    grid = torch.tensor(GRIDS["video"])
    first = tower.plan(grid, "cpu")
    assert tower.plan(grid.clone(), "cpu") is first
    assert first.cu_seqlens.dtype == torch.int32


def test_window_order_covers_every_token_once():
    order, lengths = window_order(2, 10, 6, merge=2, window=2)  # merged 5x3 per frame
    assert sorted(order.tolist()) == list(range(2 * 5 * 3))
    assert lengths == [4, 2, 4, 2, 2, 1] * 2


def test_forward_rejects_mismatched_pixels(qwen2_5):
    loaded, _ = qwen2_5
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="15 rows but grid_thw describes 16"):
        run_tower(loaded, torch.zeros(15, loaded.config.patch_features), grid)
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(1, 3, 4\)"):
        run_tower(loaded, torch.zeros(12, loaded.config.patch_features), torch.tensor([[1, 3, 4]]))


def test_configs_from_hf_and_validation():
    cfg = Qwen2_5_VisionConfig.from_hf(get_builtin_config("Qwen/Qwen2.5-VL-7B-Instruct")[1])
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.out_hidden_size) == \
        (32, 1280, 16, 3420, 3584)
    assert cfg.fullatt_block_indexes == (7, 15, 23, 31) and cfg.merged_window == 4
    cfg2 = Qwen2VisionConfig.from_hf(get_builtin_config("Qwen/Qwen2-VL-2B-Instruct")[1])
    assert (cfg2.depth, cfg2.embed_dim, cfg2.num_heads, cfg2.hidden_size) == (32, 1280, 16, 1536)
    with pytest.raises(ValueError, match="window_size=100"):
        Qwen2_5_VisionConfig(hidden_size=32, num_heads=2, window_size=100)
    with pytest.raises(ValueError, match=r"fullatt_block_indexes has \[9\]"):
        Qwen2_5_VisionConfig(depth=4, hidden_size=32, num_heads=2, fullatt_block_indexes=(1, 9))


BUILTIN_OUT = {
    "Qwen/Qwen2-VL-2B-Instruct": 1536, "Qwen/Qwen2-VL-7B-Instruct": 3584, "Qwen/Qwen2-VL-72B-Instruct": 8192,
    "Qwen/Qwen2.5-VL-3B-Instruct": 2048, "Qwen/Qwen2.5-VL-7B-Instruct": 3584,
    "Qwen/Qwen2.5-VL-32B-Instruct": 5120, "Qwen/Qwen2.5-VL-72B-Instruct": 8192,
}


@pytest.mark.parametrize("name", ["Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2.5-VL-7B-Instruct",
                                  "Qwen/Qwen2.5-VL-72B-Instruct"])
def test_builtin_parameter_count_matches_transformers(name):
    import transformers

    loaded = build_tower(name, load_format="dummy", device="meta")
    assert loaded.load_format == "dummy" and loaded.dtype == torch.bfloat16
    ours = sum(p.numel() for p in loaded.tower.parameters())
    hf_config = loaded.hf_config
    config_cls = getattr(transformers, hf_config["architectures"][0].replace("ForConditionalGeneration", "Config"))
    vision_config = config_cls(vision_config=hf_config["vision_config"]).vision_config
    tower_cls = (transformers.Qwen2_5_VisionTransformerPretrainedModel if "2_5" in hf_config["architectures"][0]
                 else transformers.models.qwen2_vl.modeling_qwen2_vl.Qwen2VisionTransformerPretrainedModel)
    with torch.device("meta"):
        theirs = sum(p.numel() for p in tower_cls(vision_config).parameters())
    print(f"{name}: {ours / 1e6:.1f}M tower parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs
    out_dim = loaded.tower.merger.fc2.weight.shape[0]
    assert out_dim == BUILTIN_OUT[name]


def test_registry_lists_both_families():
    archs = supported_architectures()
    assert "Qwen2VLForConditionalGeneration" in archs and "Qwen2_5_VLForConditionalGeneration" in archs
    for name, out in BUILTIN_OUT.items():
        spec, config = get_builtin_config(name)
        assert config["architectures"][0] in spec.architectures


def test_processor_resolves(qwen2_5):
    assert callable(qwen2_5[0].processor)


def test_model_files_name_no_platform_or_backend():
    root = pathlib.Path(__file__).resolve().parents[1] / "mmenc" / "models"
    banned = re.compile(r"cuda|flash|sdpa|AttentionBackendEnum|triton|xformers|rocm", re.IGNORECASE)
    for name in ("qwen2_vl.py", "qwen2_5_vl.py"):
        hits = [line for line in (root / name).read_text().splitlines() if banned.search(line)]
        assert not hits, f"{name} names a platform or backend: {hits}"


def test_config_json_of_saved_checkpoint_is_read(qwen2_5, tmp_path):
    loaded, _ = qwen2_5
    assert loaded.config.fullatt_block_indexes == (1, 3) and loaded.config.window_size == 56
    assert json.loads(json.dumps(loaded.hf_config))["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]


def test_bfloat16_tower_stays_close(qwen2_5):
    """bf16 weights and activations (rotary and norm statistics in float32) against the fp32 reference."""
    loaded, hf_model = qwen2_5
    bf16 = build_tower(loaded.model, dtype="bfloat16", device="cpu")
    assert bf16.tower.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
    grid = torch.tensor(GRIDS["mixed"])
    pixels = random_pixels(grid, loaded.config.patch_features)
    out = run_tower(bf16, pixels, grid).embeddings
    assert out.dtype == torch.bfloat16
    err = relative_error(out, hf_tower_output(hf_model, pixels, grid))
    print(f"bf16 relative error {err:.2e} (tolerance 3e-02)")
    assert err < 3e-2
