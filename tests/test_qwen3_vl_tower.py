"""Qwen3-VL's learned position table and DeepStack (fp32, CPU): grids that stretch and shrink the
6x6 table against transformers' own tower (embeddings and every deepstack feature), the bilinear
taps, the legacy "visual." checkpoint prefix, and the family's config fields. Parity on a mixed
batch, MoE checkpoints, errors, built-ins and parallel modes are in test_towers_generic.py."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmenc.engine.tower import build_tower, run_tower
from mmenc.layers.pos_embed import axis_taps
from mmenc.models.qwen3_vl import Qwen3VisionConfig
from mmenc.models.registry import get_builtin_config
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

pytest.importorskip("transformers")

TOL = 1e-5
ARCH = "Qwen3VLForConditionalGeneration"

# (t, h, w) in patches; the tiny position table is 6x6, so these grids stretch it (and shrink it on one side).
GRIDS = {
    "video": [[3, 14, 16]],
    "wide": [[1, 2, 14]],
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, model = ck.FAMILIES[ARCH].save(tmp_path_factory.mktemp("qwen3_vl"))
    return build_tower(str(folder), device="cpu"), model, folder


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_position_table_resampling_matches_transformers(dense, case):
    loaded, hf_model, _ = dense
    family = ck.FAMILIES[ARCH]
    grid = torch.tensor(GRIDS[case])
    pixels = family.pixels(grid)
    want, want_deepstack = family.reference(hf_model, pixels, grid)
    out = run_tower(loaded, pixels, grid)
    err = assert_close(out.embeddings, want, f"{ARCH} grid={GRIDS[case]} embeddings", TOL)
    print(f"{ARCH} grid={GRIDS[case]}: relative error {err:.2e} (tolerance {TOL:.0e})")
    deepstack = out.extras["deepstack"]
    assert len(deepstack) == len(want_deepstack) == len(loaded.config.deepstack_visual_indexes)
    for k, (got, ref) in enumerate(zip(deepstack, want_deepstack)):
        assert_close(got, ref, f"{ARCH} grid={GRIDS[case]} deepstack[{k}]", TOL)


def test_legacy_visual_prefix_loads(dense, tmp_path):
    loaded, _, folder = dense
    tensors = load_file(str(folder / "model.safetensors"))
    legacy = {name.replace("model.visual.", "visual.", 1): t for name, t in tensors.items()}
    assert any(n.startswith("visual.") for n in legacy) and not any(n.startswith("model.visual.") for n in legacy)
    save_file(legacy, str(tmp_path / "model.safetensors"))
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    old = build_tower(str(tmp_path), device="cpu")
    grid = torch.tensor([[1, 2, 2], [2, 8, 6]])
    pixels = ck.FAMILIES[ARCH].pixels(grid, seed=1)
    assert torch.equal(run_tower(old, pixels, grid).embeddings, run_tower(loaded, pixels, grid).embeddings)


def test_position_taps_are_cached_and_sum_to_one(dense):
    loaded = dense[0]
    assert loaded.config.deepstack_visual_indexes == (0, 2) and loaded.config.num_position_embeddings == 36
    tower = loaded.tower
    plan = tower.plan(torch.tensor(GRIDS["video"]), "cpu")
    assert plan.pos_index.shape == (3 * 14 * 16, 4) and plan.pos_weight.dtype == torch.float32
    assert tower.pos_embed.frame_taps(14, 16) is tower.pos_embed.frame_taps(14, 16)
    # bilinear weights of each patch sum to one
    assert torch.allclose(plan.pos_weight.sum(-1), torch.ones(3 * 14 * 16))


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


BUILTIN_DEEPSTACK = {  # name: (deepstack layers, head size)
    "Qwen/Qwen3-VL-2B-Instruct": ((5, 11, 17), 64),
    "Qwen/Qwen3-VL-8B-Instruct": ((8, 16, 24), 72),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": ((8, 16, 24), 72),
}


@pytest.mark.parametrize("name", sorted(BUILTIN_DEEPSTACK))
def test_builtin_deepstack_and_position_table(name):
    spec, hf_config = get_builtin_config(name)
    cfg = spec.config_from_hf(hf_config)
    assert (cfg.deepstack_visual_indexes, cfg.head_dim) == BUILTIN_DEEPSTACK[name]
    assert (cfg.patch_size, cfg.num_position_embeddings, cfg.hidden_act) == (16, 2304, "gelu_pytorch_tanh")
