"""Kimi MoonViT towers: video chunks (temporal pooling, time embedding) against transformers' own
(fp32 CPU), the published checkpoint names and config dialects, the processor, and Kimi-VL (remote
code, not in transformers) against the K2.5 tower with the same weights renamed. Parity on a mixed
batch of images, errors, built-in widths and parallel modes are in test_towers_generic.py."""
import dataclasses
import json

import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.loader import iter_tower_tensors
from mmenc.models.kimi_vit import (KIMI_K25_WEIGHT_MAP, KIMI_VL_WEIGHT_MAP, KimiVisionConfig, KimiVLVisionConfig,
                                   KimiVLVisionTower, frame_sincos)
from mmenc.models.registry import get_builtin_config, get_model_spec
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import relative_error

TOL = 1e-5
# (t, h, w) in patches. The tiny position grid is 6x6: grids below, at and above it resample it.
GRIDS = {
    "mixed_images": [[1, 2, 2], [1, 6, 6], [1, 4, 10], [1, 8, 2]],
    "video_and_images": [[4, 4, 6], [1, 6, 4], [2, 2, 2], [3, 4, 4]],
}


def random_patches(grid_thw, seed=0):
    """pixel_values [patches, 3, 14, 14], as Kimi-K2.5's processor gives them."""
    return ck.FAMILIES["Kimi_K25ForConditionalGeneration"].pixels(grid_thw, seed=seed)


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Kimi_K25ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no Kimi_K25ForConditionalGeneration")
    folder, model = ck.save_kimi_k25(tmp_path_factory.mktemp("kimi_k25"))
    return build_tower(str(folder), device="cpu"), model, folder


def test_video_chunks_match_transformers(k25):
    loaded, model, _ = k25
    case = "video_and_images"
    grid = torch.tensor(GRIDS[case])
    pixels = random_patches(grid)
    ref = ck.hf_kimi_embeddings(model, pixels, grid)
    out = run_tower(loaded, pixels, grid).embeddings
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    err = relative_error(out, ref)
    print(f"Kimi-K2.5 grid={GRIDS[case]}: relative error {err:.2e} (tolerance {TOL:.0e})")
    assert err < TOL, f"relative error {err:.2e} exceeds tolerance {TOL:.0e} for grid {GRIDS[case]}"
    assert loaded.output_tokens(grid) == [h * w // 4 for _, h, w in GRIDS[case]]
    # flattened rows are the same input
    flat = run_tower(loaded, pixels.flatten(1), grid).embeddings
    assert relative_error(flat, out) == 0.0


def test_kimi_k25_checkpoint_names_are_the_published_ones(k25):
    _, _, folder = k25
    names = json.loads((folder / "config.json").read_text())["architectures"]
    assert names == ["Kimi_K25ForConditionalGeneration"]
    from mmenc.loader import tensor_files

    saved = set(tensor_files(folder))
    assert {"vision_tower.encoder.blocks.0.wqkv.weight", "vision_tower.patch_embed.pos_emb.weight",
            "mm_projector.proj.0.weight"} <= saved
    tower_names = {n for n, _ in iter_tower_tensors(folder, get_model_spec("KimiK25ForConditionalGeneration")
                                                            .weight_prefixes)}
    assert "pre_norm.weight" in tower_names and not any(n.startswith("language_model") for n in tower_names)


def test_video_chunk_is_pooled_and_frames_are_not_independent(k25):
    loaded, _, _ = k25
    grid = torch.tensor([[2, 4, 4]])
    pixels = random_patches(grid, seed=5)
    video = run_tower(loaded, pixels, grid).embeddings
    assert video.shape[0] == 4  # 4x4 patches -> 2x2 merged tokens, frames pooled
    frames = [run_tower(loaded, pixels[i * 16:(i + 1) * 16], torch.tensor([[1, 4, 4]])).embeddings for i in range(2)]
    assert relative_error(video, (frames[0] + frames[1]) / 2) > 1e-3  # attention spans the chunk + time embedding


def test_plan_has_one_segment_per_chunk_and_limits_frames(k25):
    tower = k25[0].tower
    grid = torch.tensor(GRIDS["video_and_images"])
    plan = tower.plan(grid, "cpu")
    assert torch.diff(plan.cu_seqlens).tolist() == [96, 24, 8, 48]  # one segment per chunk, all its frames
    assert sorted(plan.order.tolist()) == list(range(plan.num_patches))
    assert tower.plan(torch.tensor([[1, 4, 4]]), "cpu").frame_index is None
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(5, 2, 2\): t=5"):
        tower.plan(torch.tensor([[1, 2, 2], [5, 2, 2]]), "cpu")


def test_frame_sincos_rows():
    table = frame_sincos(4, 8)
    assert table.shape == (5, 8) and table[0].abs().sum() == 0
    assert torch.allclose(table[1], torch.tensor([0.0] * 4 + [1.0] * 4))  # frame 0 of a video: sin 0 | cos 0


def test_kimi_vl_is_the_image_member_of_the_family(k25):
    """Kimi-VL's MoonViT (remote code) has the K2.5 tower's architecture without the time embedding
    and its projector renamed: with the same weights under Kimi-VL's names, images match exactly."""
    loaded, _, folder = k25
    config = dataclasses.replace(loaded.config, pos_emb_time=0)
    vl = KimiVLVisionTower(config).eval()
    names = {}
    for name, tensor in iter_tower_tensors(folder, get_model_spec("KimiK25ForConditionalGeneration").weight_prefixes):
        vl_name = {"proj.0.weight": "linear_1.weight", "proj.0.bias": "linear_1.bias", "proj.2.weight": "linear_2.weight",
                   "proj.2.bias": "linear_2.bias"}.get(name, name)
        names[vl_name] = tensor
    loaded_params = vl.load_weights(names.items())
    assert loaded_params == {n for n, _ in vl.named_parameters()}
    grid = torch.tensor(GRIDS["mixed_images"])
    pixels = random_patches(grid, seed=2)
    with torch.inference_mode():
        ref = run_tower(loaded, pixels, grid).embeddings
        out = vl(pixels, grid).embeddings
    err = relative_error(out, ref)
    print(f"Kimi-VL tower vs K2.5 tower, same weights, grid={GRIDS['mixed_images']}: relative error {err:.2e}")
    assert err < TOL
    with pytest.raises(ValueError, match=r"images only"):
        vl.plan(torch.tensor([[2, 2, 2]]), "cpu")


def test_weight_maps_name_published_tensors():
    block = "encoder.blocks.3."
    for ckpt, param in [("norm0.weight", "norm1.weight"), ("norm1.bias", "norm2.bias"), ("wqkv.weight", "attn.qkv.weight"),
                        ("wo.bias", "attn.proj.bias"), ("mlp.fc0.weight", "mlp.fc1.weight"),
                        ("mlp.fc1.weight", "mlp.fc2.weight")]:
        for weight_map in (KIMI_K25_WEIGHT_MAP, KIMI_VL_WEIGHT_MAP):
            assert weight_map.to_param(block + ckpt) == (block + param, None)
    assert KIMI_K25_WEIGHT_MAP.to_param("proj.2.weight") == ("merger.fc2.weight", None)
    assert KIMI_VL_WEIGHT_MAP.to_param("linear_1.bias") == ("merger.fc1.bias", None)
    assert KIMI_VL_WEIGHT_MAP.to_param("pre_norm.weight") == ("merger.ln_q.weight", None)
    for name in ("patch_embed.proj.weight", "patch_embed.pos_emb.weight", "encoder.final_layernorm.bias"):
        assert KIMI_K25_WEIGHT_MAP.to_param(name) == (name, None)


def test_configs_from_hf_dialects_and_unsupported_variants():
    published = KimiVisionConfig.from_hf(get_builtin_config("moonshotai/Kimi-K2.5")[1])
    assert (published.depth, published.hidden_size, published.num_heads, published.head_dim,
            published.intermediate_size, published.out_hidden_size, published.pos_emb_time) == \
        (27, 1152, 16, 72, 4304, 7168, 4)
    transformers_style = KimiVisionConfig.from_hf({"vision_config": {"hidden_size": 32, "num_attention_heads": 2,
                                                                      "num_hidden_layers": 3, "pos_emb_height": 6,
                                                                      "pos_emb_width": 6},
                                                   "text_config": {"hidden_size": 24}})
    assert (transformers_style.depth, transformers_style.out_hidden_size, transformers_style.pos_emb_height) == (3, 24, 6)
    vl = KimiVLVisionConfig.from_hf(get_builtin_config("moonshotai/Kimi-VL-A3B-Instruct")[1])
    assert (vl.depth, vl.hidden_size, vl.out_hidden_size, vl.pos_emb_time) == (27, 1152, 2048, 0)
    with pytest.raises(ValueError, match=r"mm_projector_type='patchmergerv2'"):
        KimiVisionConfig.from_hf({"vision_config": {"mm_projector_type": "patchmergerv2"}})
    with pytest.raises(ValueError, match=r"qkv_hidden_size=1536"):
        KimiVisionConfig.from_hf({"vision_config": {"qkv_hidden_size": 1536}})


@pytest.mark.parametrize("name,arch", [
    ("moonshotai/Kimi-K2.5", "KimiK25ForConditionalGeneration"),
    ("moonshotai/Kimi-VL-A3B-Instruct", "KimiVLForConditionalGeneration"),
])
def test_builtin_moonvit_size(name, arch):
    """No transformers module holds MoonViT and its projector together, so the size is checked here."""
    loaded = build_tower(name, load_format="dummy", device="meta")
    assert loaded.spec is get_model_spec(arch)
    tower = loaded.tower
    assert tower.merger.fc2.weight.shape[1] == 4608
    assert tower.patch_embed.pos_emb.weight.shape == (64 * 64, 1152)
    assert len(tower.encoder.blocks) == 27 and tower.encoder.blocks[0].attn.head_dim == 72
    params = sum(p.numel() for p in tower.parameters())
    vit = params - sum(p.numel() for p in tower.merger.parameters())
    print(f"{name}: MoonViT {vit / 1e6:.1f}M parameters, projector {(params - vit) / 1e6:.1f}M")
    assert 400e6 < vit < 420e6  # "MoonViT-SO-400M"


def test_processor_from_hf_feeds_the_tower(k25):
    """mmenc's Kimi-K2.5 processor output (pixel_values [P, C, p, p], grid rows [1, h, w]) goes
    straight into the tower and matches transformers on the same pixels."""
    pytest.importorskip("PIL")
    from PIL import Image

    loaded, model, _ = k25
    processor = get_model_spec("Kimi_K25ForConditionalGeneration").processor_from_hf({})
    g = torch.Generator().manual_seed(1)
    images = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
              for h, w in [(56, 84), (30, 40)]]
    pixels, grid = processor(images)
    assert pixels.shape[1:] == (3, 14, 14) and grid[:, 0].tolist() == [1, 1] and grid[0].tolist() == [1, 4, 6]
    err = relative_error(run_tower(loaded, pixels, grid).embeddings, ck.hf_kimi_embeddings(model, pixels, grid))
    assert err < TOL, f"relative error {err:.2e} exceeds tolerance {TOL:.0e}"
    with pytest.raises(ValueError, match="encode_pixels"):
        get_model_spec("KimiVLForConditionalGeneration").processor_from_hf({})
