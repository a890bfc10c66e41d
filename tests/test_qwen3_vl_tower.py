"""Qwen3-VL tower (dense and MoE checkpoints) against transformers' own, through mmenc's loader (fp32, CPU):
embeddings and DeepStack features; built-in configs against transformers' tower on the meta device."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import hf_tower_outputs, random_pixels, relative_error, save_qwen3_vl
from mmenc.engine.runner import build_tower, run_tower
from mmenc.layers.pos_embed import axis_taps
from mmenc.models.qwen3_vl import Qwen3VisionConfig
from mmenc.models.registry import get_builtin_config, get_model_spec

pytest.importorskip("transformers")

TOL = 1e-5

# (t, h, w) in patches; the tiny position table is 6x6, so grids both shrink and stretch it.
GRIDS = {
    "mixed": [[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 10, 4]],  # smallest, non-square, video, tall
    "video": [[3, 14, 16]],
    "wide": [[1, 2, 14]],
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, model = save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl"))
    return build_tower(str(folder), device="cpu"), model, folder


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    folder, model = save_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_moe"), moe=True)
    return build_tower(str(folder), device="cpu"), model


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    err = relative_error(got, want)
    print(f"{what}: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert err < TOL, f"{what}: relative error {err:.2e} exceeds tolerance {TOL:.0e}"


def _check_parity(loaded, hf_model, grid):
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixels = random_pixels(grid_thw, loaded.config.patch_features)
    ref, ref_deepstack = hf_tower_outputs(hf_model, pixels, grid_thw)
    out = run_tower(loaded, pixels, grid_thw)
    arch = loaded.spec.architectures[0] if "Moe" not in type(hf_model).__name__ else type(hf_model).__name__
    _check(out.embeddings, ref, f"{arch} grid={grid} embeddings")
    deepstack = out.extras["deepstack"]
    assert len(deepstack) == len(ref_deepstack) == len(loaded.config.deepstack_visual_indexes)
    for k, (got, want) in enumerate(zip(deepstack, ref_deepstack)):
        _check(got, want, f"{arch} grid={grid} deepstack[{k}]")
    assert sum(loaded.output_tokens(grid_thw)) == out.embeddings.shape[0]
    return out


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_qwen3_vl_matches_transformers(dense, case):
    loaded, hf_model, _ = dense
    assert loaded.dtype == torch.float32 and loaded.load_format == "auto"
    _check_parity(loaded, hf_model, GRIDS[case])


def test_qwen3_vl_moe_checkpoint_matches_transformers(moe):
    loaded, hf_model = moe
    assert loaded.hf_config["architectures"] == ["Qwen3VLMoeForConditionalGeneration"]
    _check_parity(loaded, hf_model, GRIDS["mixed"])


def test_legacy_visual_prefix_loads(dense, tmp_path):
    loaded, hf_model, folder = dense
    tensors = load_file(str(folder / "model.safetensors"))
    legacy = {name.replace("model.visual.", "visual.", 1): t for name, t in tensors.items()}
    assert any(n.startswith("visual.") for n in legacy) and not any(n.startswith("model.visual.") for n in legacy)
    save_file(legacy, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    old = build_tower(str(tmp_path), device="cpu")
    grid = torch.tensor(GRIDS["mixed"])
    pixels = random_pixels(grid, loaded.config.patch_features, seed=1)
    assert torch.equal(run_tower(old, pixels, grid).embeddings, run_tower(loaded, pixels, grid).embeddings)


def test_batch_equals_images_one_by_one(dense):
    loaded = dense[0]
    grid = torch.tensor(GRIDS["mixed"])
    pixels = random_pixels(grid, loaded.config.patch_features, seed=3)
    together = run_tower(loaded, pixels, grid)
    parts, start = [], 0
    for row in grid:
        n = int(row.prod())
        parts.append(run_tower(loaded, pixels[start:start + n], row[None]))
        start += n
    _check(together.embeddings, torch.cat([p.embeddings for p in parts]), "batch vs one by one")
    for k, feature in enumerate(together.extras["deepstack"]):
        _check(feature, torch.cat([p.extras["deepstack"][k] for p in parts]), f"batch vs one by one deepstack[{k}]")


def test_plan_and_position_taps_are_cached(dense):
    tower = dense[0].tower
    grid = torch.tensor(GRIDS["video"])
    first = tower.plan(grid, "cpu")
    assert tower.plan(grid.clone(), "cpu") is first
    assert first.pos_index.shape == (3 * 14 * 16, 4) and first.pos_weight.dtype == torch.float32
    assert tower.pos_embed.frame_taps(14, 16) is tower.pos_embed.frame_taps(14, 16)
    # bilinear weights of each patch sum to one
    assert torch.allclose(first.pos_weight.sum(-1), torch.ones(3 * 14 * 16))


def test_bilinear_taps_match_interpolate():
    table = torch.randn(1, 3, 6, 6)
    for h, w in [(1, 7), (4, 10), (14, 3)]:
        rows, row_w = axis_taps(h, 6, "bilinear", align_corners=True)
        cols, col_w = axis_taps(w, 6, "bilinear", align_corners=True)
        ours = torch.einsum("hi,wj,chiwj->chw", row_w.float(), col_w.float(),
                            table[0][:, rows][:, :, :, cols])
        ref = torch.nn.functional.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]
        assert torch.allclose(ours, ref, atol=1e-6), f"{h}x{w}: max error {(ours - ref).abs().max():.2e}"


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="num_position_embeddings=35 must be a square"):
        Qwen3VisionConfig(hidden_size=32, num_heads=2, num_position_embeddings=35, deepstack_visual_indexes=())
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes=\[1, 9\]"):
        Qwen3VisionConfig(depth=4, hidden_size=32, num_heads=2, deepstack_visual_indexes=(1, 9))
    with pytest.raises(ValueError, match="hidden_size=30"):
        Qwen3VisionConfig(hidden_size=30, num_heads=2, deepstack_visual_indexes=())


BUILTINS = {  # name: (depth, hidden, heads, intermediate, out_hidden, deepstack)
    "Qwen/Qwen3-VL-2B-Instruct": (24, 1024, 16, 4096, 2048, (5, 11, 17)),
    "Qwen/Qwen3-VL-4B-Instruct": (24, 1024, 16, 4096, 2560, (5, 11, 17)),
    "Qwen/Qwen3-VL-8B-Instruct": (27, 1152, 16, 4304, 4096, (8, 16, 24)),
    "Qwen/Qwen3-VL-32B-Instruct": (27, 1152, 16, 4304, 5120, (8, 16, 24)),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": (27, 1152, 16, 4304, 2048, (8, 16, 24)),
    "Qwen/Qwen3-VL-235B-A22B-Instruct": (27, 1152, 16, 4304, 4096, (8, 16, 24)),
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_configs(name):
    spec, hf_config = get_builtin_config(name)
    assert get_model_spec(hf_config["architectures"][0]) is spec
    cfg = spec.config_from_hf(hf_config)
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.out_hidden_size,
            cfg.deepstack_visual_indexes) == BUILTINS[name]
    assert (cfg.patch_size, cfg.num_position_embeddings, cfg.hidden_act) == (16, 2304, "gelu_pytorch_tanh")
    assert cfg.head_dim == (64 if cfg.hidden_size == 1024 else 72)


@pytest.mark.parametrize("name", ["Qwen/Qwen3-VL-8B-Instruct", "Qwen/Qwen3-VL-30B-A3B-Instruct"])
def test_builtin_dummy_build_matches_transformers_parameter_count(name):
    import transformers
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    loaded = build_tower(name, load_format="dummy", device="meta")
    assert loaded.load_format == "dummy" and loaded.dtype == torch.bfloat16
    ours = sum(p.numel() for p in loaded.tower.parameters())
    vision_config = transformers.Qwen3VLConfig(vision_config=loaded.hf_config["vision_config"]).vision_config
    with torch.device("meta"):
        theirs = sum(p.numel() for p in Qwen3VLVisionModel(vision_config).parameters())
    print(f"{name}: {ours / 1e6:.1f}M tower parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs
    assert loaded.tower.merger.fc2.weight.shape[0] == BUILTINS[name][4]
    assert len(loaded.tower.deepstack_merger_list) == 3


def test_processor_and_saved_config(dense):
    loaded = dense[0]
    assert callable(loaded.processor)
    assert loaded.config.deepstack_visual_indexes == (0, 2) and loaded.config.num_position_embeddings == 36
    assert json.loads(json.dumps(loaded.hf_config))["architectures"] == ["Qwen3VLForConditionalGeneration"]


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_one(dense):
    """Weights mode over 2 gloo CPU workers: heads, MLPs and (DeepStack) mergers split in two."""
    from mmenc.engine.workers import WorkerGroup

    loaded, _, folder = dense
    grid = torch.tensor([[1, 2, 2], [2, 8, 6], [1, 10, 4]])
    pixels = random_pixels(grid, loaded.config.patch_features, seed=5)
    want = run_tower(loaded, pixels, grid)
    with WorkerGroup(2, dict(model=str(folder), load_format="auto", dtype=torch.float32), mode="weights",
                     device_type="cpu", timeout_s=120) as group:
        got = group.run(pixels, grid)
    _check(got.embeddings, want.embeddings, "tp=2 embeddings")
    assert len(got.extras["deepstack"]) == len(want.extras["deepstack"])
    for k, (g, w) in enumerate(zip(got.extras["deepstack"], want.extras["deepstack"])):
        _check(g, w, f"tp=2 deepstack[{k}]")
