"""GLM-4.1V tower (Glm4v and Glm4vMoe checkpoints) against transformers' own, through mmenc's loader
(fp32, CPU); built-in configs against transformers' tower on the meta device.

transformers' GLM-4.1V model hands a video to its tower as t rows of (1, h, w) (its tower indexes
grid rows by frame, so a (t > 1, h, w) row fails there); the reference here does the same, while
mmenc's tower takes the (t, h, w) row as is.
"""
import pytest
import torch

from checkpoints import hf_tower_outputs, random_pixels, relative_error, save_glm4v
from mmenc.engine.runner import build_tower, run_tower
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.models.glm4v import Glm4vVisionConfig
from mmenc.models.registry import get_builtin_config, get_model_spec

pytest.importorskip("transformers")

TOL = 1e-5

# (t, h, w) in patches; the tiny position table is 6x6 (image_size 84 / patch 14).
GRIDS = {
    "mixed": [[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 10, 4]],  # smallest, non-square, video, tall
    "video": [[3, 14, 16]],
    "table_size": [[1, 6, 6]],
    "wide": [[1, 2, 14]],
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    folder, model = save_glm4v(tmp_path_factory.mktemp("glm4v"))
    return build_tower(str(folder), device="cpu"), model, folder


@pytest.fixture(scope="module")
def moe(tmp_path_factory):  # qkv bias on, to load and run that path too
    folder, model = save_glm4v(tmp_path_factory.mktemp("glm4v_moe"), moe=True, vision=dict(attention_bias=True))
    return build_tower(str(folder), device="cpu"), model


def _frames(grid_thw: torch.Tensor) -> torch.Tensor:
    """(t, h, w) rows -> t rows of (1, h, w), as transformers' Glm4vModel.get_video_features does."""
    return torch.cat([torch.tensor([[1, h, w]]).repeat(t, 1) for t, h, w in grid_thw.tolist()])


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != reference {tuple(want.shape)}"
    err = relative_error(got, want)
    print(f"{what}: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert err < TOL, f"{what}: relative error {err:.2e} exceeds tolerance {TOL:.0e}"


def _check_parity(loaded, hf_model, grid):
    grid_thw = torch.tensor(grid, dtype=torch.int64)
    pixels = random_pixels(grid_thw, loaded.config.patch_features)
    ref, _ = hf_tower_outputs(hf_model, pixels, _frames(grid_thw))
    out = run_tower(loaded, pixels, grid_thw)
    _check(out.embeddings, ref, f"{type(hf_model).__name__} grid={grid}")
    assert out.extras == {}
    assert sum(loaded.output_tokens(grid_thw)) == out.embeddings.shape[0]


@pytest.mark.parametrize("case", sorted(GRIDS))
def test_glm4v_matches_transformers(dense, case):
    loaded, hf_model, _ = dense
    assert loaded.dtype == torch.float32 and loaded.load_format == "auto"
    _check_parity(loaded, hf_model, GRIDS[case])


def test_glm4v_moe_checkpoint_matches_transformers(moe):
    loaded, hf_model = moe
    assert loaded.hf_config["architectures"] == ["Glm4vMoeForConditionalGeneration"]
    assert loaded.tower.blocks[0].attn.qkv.bias is not None and loaded.tower.blocks[0].attn.proj.bias is None
    _check_parity(loaded, hf_model, GRIDS["mixed"])


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
    with pytest.raises(ValueError, match="hidden_size=30"):
        Glm4vVisionConfig(hidden_size=30, num_heads=2)


BUILTINS = {  # name: (depth, hidden, heads, intermediate, out_hidden, architecture)
    "zai-org/GLM-4.1V-9B-Thinking": (24, 1536, 12, 13696, 4096, "Glm4vForConditionalGeneration"),
    "zai-org/GLM-4.5V": (24, 1536, 12, 10944, 4096, "Glm4vMoeForConditionalGeneration"),
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_builtin_dummy_build_matches_transformers_parameter_count(name):
    import transformers

    spec, hf_config = get_builtin_config(name)
    arch = hf_config["architectures"][0]
    assert get_model_spec(arch) is spec and arch == BUILTINS[name][5]
    loaded = build_tower(name, load_format="dummy", device="meta")
    cfg = loaded.config
    assert (cfg.depth, cfg.hidden_size, cfg.num_heads, cfg.intermediate_size, cfg.out_hidden_size) == \
        BUILTINS[name][:5]
    assert (cfg.num_positions, cfg.head_dim, cfg.attention_bias) == (576, 128, False)
    ours = sum(p.numel() for p in loaded.tower.parameters())
    prefix = arch.replace("ForConditionalGeneration", "")
    vision_config = getattr(transformers, f"{prefix}Config")(vision_config=hf_config["vision_config"]).vision_config
    module = getattr(transformers.models, "glm4v_moe" if "Moe" in prefix else "glm4v")
    tower_cls = getattr(getattr(module, f"modeling_{module.__name__.rsplit('.', 1)[-1]}"), f"{prefix}VisionModel")
    with torch.device("meta"):
        theirs = sum(p.numel() for p in tower_cls(vision_config).parameters())
    print(f"{name}: {ours / 1e6:.1f}M tower parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs


def test_processor_resolves(dense):
    assert callable(dense[0].processor)


@pytest.mark.slow
def test_tensor_parallel_two_ranks_match_one(dense):
    """Weights mode over 2 gloo CPU workers: heads, MLPs and the merger split in two."""
    from mmenc.engine.workers import WorkerGroup

    loaded, _, folder = dense
    grid = torch.tensor([[1, 2, 2], [2, 8, 6], [1, 10, 4]])
    pixels = random_pixels(grid, loaded.config.patch_features, seed=5)
    want = run_tower(loaded, pixels, grid)
    with WorkerGroup(2, dict(model=str(folder), load_format="auto", dtype=torch.float32), mode="weights",
                     device_type="cpu", timeout_s=120) as group:
        got = group.run(pixels, grid)
    _check(got.embeddings, want.embeddings, "tp=2 embeddings")
