"""GLM-4.1V's bicubic position table and video rows (fp32, CPU) against transformers' own tower.

transformers' GLM-4.1V model hands a video to its tower as t rows of (1, h, w) (its tower indexes
grid rows by frame, so a (t > 1, h, w) row fails there); the table's reference does the same, while
mmenc's tower takes the (t, h, w) row as is. Parity on a mixed batch, the MoE checkpoint (with qkv
bias), errors, built-ins and parallel modes are in test_towers_generic.py.
"""
import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.models.glm4v import Glm4vVisionConfig
from mmenc.models.registry import get_builtin_config
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

pytest.importorskip("transformers")

TOL = 1e-5
ARCH = "Glm4vForConditionalGeneration"

# (t, h, w) in patches; the tiny position table is 6x6 (image_size 84 / patch 14).
GRIDS = {
    "video": [[3, 14, 16]],  # three frames in one row, a stretched table
    "table_size": [[1, 6, 6]],
    "wide": [[1, 2, 14]],
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, model = ck.FAMILIES[ARCH].save(tmp_path_factory.mktemp("glm4v"))
    return build_tower(str(folder), device="cpu"), model


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_position_table_and_video_rows_match_transformers(dense, case):
    loaded, hf_model = dense
    family = ck.FAMILIES[ARCH]
    grid = torch.tensor(GRIDS[case])
    pixels = family.pixels(grid)
    want, _ = family.reference(hf_model, pixels, grid)
    out = run_tower(loaded, pixels, grid)
    err = assert_close(out.embeddings, want, f"{ARCH} grid={GRIDS[case]}", TOL)
    print(f"{ARCH} grid={GRIDS[case]}: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert out.extras == {}


def test_bicubic_taps_match_grid_sample():
    pe = InterpolatedPosEmbed(36, 5, mode="bicubic", align_corners=False)
    pe.weight.data.normal_()
    table = pe.weight.view(6, 6, 5).permute(2, 0, 1)[None]
    for h, w in [(1, 7), (4, 10), (14, 3), (6, 6)]:
        ours = pe(*pe.taps(((1, h, w),)))
        ys, xs = ((torch.arange(h) + 0.5) / h) * 2 - 1, ((torch.arange(w) + 0.5) / w) * 2 - 1
        grid = torch.stack(torch.meshgrid(xs, ys, indexing="xy"), -1)[None]  # [1, h, w, (x, y)]
        ref = torch.nn.functional.grid_sample(table, grid, mode="bicubic", align_corners=False,
                                              padding_mode="border")[0].permute(1, 2, 0).reshape(-1, 5)
        assert torch.allclose(ours, ref, atol=1e-5), f"{h}x{w}: max error {(ours - ref).abs().max():.2e}"


def test_downsample_weight_shape_error_names_the_tensor(dense):
    tower = dense[0].tower
    with pytest.raises(ValueError, match=r"checkpoint tensor 'downsample.weight'.*\(24, 32, 2, 2\)"):
        tower.load_weights([("downsample.weight", torch.zeros(24, 32, 3, 3))])


def test_config_validation_names_the_value():
    with pytest.raises(ValueError, match="image_size=100"):
        Glm4vVisionConfig(hidden_size=32, num_heads=2, image_size=100, patch_size=14)


@pytest.mark.parametrize("name", ["zai-org/GLM-4.1V-9B-Thinking", "zai-org/GLM-4.5V"])
def test_builtin_position_table_and_heads(name):
    spec, hf_config = get_builtin_config(name)
    cfg = spec.config_from_hf(hf_config)
    assert (cfg.num_positions, cfg.head_dim, cfg.attention_bias) == (576, 128, False)
