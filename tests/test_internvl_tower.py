"""InternViT's own math beyond the generic table: the dense [tiles, 1 + h*w] path (InternVL's 448 px
tiles) against transformers' get_image_features, InternViT-6B's variant (RMSNorm, q/k norm over all
heads, no qkv bias, final LayerNorm) in one process and over 2 tensor-parallel ranks, dense equal to
packed, built-in sizes against transformers' parameter counts, and the dynamic-tiling processor
against transformers' GotOcr2 image processor."""
import importlib.util

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image

from mmenc.engine.tower import build_tower, run_tower
from mmenc.models.registry import get_builtin_config
from mmenc.preprocess.internvl import InternVLProcessor, InternVLProcessorConfig, internvl_from_hf, tile_grid
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close
from mmenc.testing.spmd import check_modes_match, free_port

transformers = pytest.importorskip("transformers")

TOL = 1e-5
SIX_B = dict(norm_type="rms_norm", use_qk_norm=True, attention_bias=False, use_mean_pooling=False,
             num_attention_heads=4)  # head size 8: 2 heads per rank at TP=2, q/k norm across the ranks


@pytest.fixture(scope="module")
def six_b(tmp_path_factory):
    return ck.save_internvl(tmp_path_factory.mktemp("internvl6b"), vision=SIX_B)


def test_dense_tiles_match_transformers_get_image_features(six_b):
    """Native-size tiles (6x6 patches, the position table used as is) run as one dense batch; the
    reference is transformers' own get_image_features on the stacked tiles."""
    folder, hf_model = six_b
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[3, 6, 6], [2, 6, 6]])  # two images: 3 and 2 tiles
    pixels = ck.FAMILIES["InternVLForConditionalGeneration"].pixels(grid, seed=5)
    assert loaded.tower.plan(grid, "cpu").dense
    got = run_tower(loaded, pixels, grid).embeddings
    images = pixels.view(5, 6, 6, 3, 14, 14).permute(0, 3, 1, 4, 2, 5).reshape(5, 3, 84, 84)
    with torch.no_grad():
        want = hf_model.model.get_image_features(pixel_values=images).pooler_output.reshape(-1, got.shape[-1])
    err = assert_close(got, want, "InternViT-6B variant, dense tiles", TOL)
    print(f"InternViT-6B variant dense: relative error {err:.2e} (tolerance {TOL:.0e})")
    mixed = torch.tensor([[3, 6, 6], [2, 6, 6], [1, 4, 8]])  # a third size: the packed path
    more = torch.cat([pixels, ck.FAMILIES["InternVLForConditionalGeneration"].pixels(mixed[2:], seed=6)])
    assert not loaded.tower.plan(mixed, "cpu").dense
    packed = run_tower(loaded, more, mixed).embeddings
    assert_close(packed[:got.shape[0]], got, "the same tiles packed beside another size", TOL)
    want_all = ck.hf_internvl_outputs(hf_model, more, mixed)[0]
    assert_close(packed, want_all, "InternViT-6B variant, packed", TOL)


def test_six_b_variant_tensor_parallel_equals_one_process(six_b):
    folder, _ = six_b
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[2, 6, 6], [1, 4, 8]])
    pixels = ck.FAMILIES["InternVLForConditionalGeneration"].pixels(grid, seed=7)
    want = run_tower(loaded, pixels, grid)
    mp.spawn(check_modes_match, args=(2, free_port(), [(str(folder), pixels, grid, want)]), nprocs=2, join=True)


def test_config_rejects_what_it_does_not_implement():
    from mmenc.models.internvl import InternVisionConfig

    base = {"architectures": ["InternVLForConditionalGeneration"], "vision_config": {}, "text_config": {}}
    with pytest.raises(ValueError, match=r"vision_feature_layer=-2"):
        InternVisionConfig.from_hf({**base, "vision_feature_layer": -2})
    with pytest.raises(ValueError, match=r"downsample_ratio=0.3"):
        InternVisionConfig.from_hf({**base, "downsample_ratio": 0.3})
    with pytest.raises(ValueError, match=r"image_size=\[448, 224\]"):
        InternVisionConfig.from_hf({**base, "vision_config": {"image_size": [448, 224]}})
    cfg = InternVisionConfig.from_hf({**base, "vision_config": {"use_mean_pooling": False, "image_size": [448, 448]},
                                      "text_config": {"hidden_size": 3584}})
    assert (cfg.final_norm, cfg.image_size, cfg.out_hidden_size, cfg.spatial_merge_size) == (True, 448, 3584, 2)


@pytest.mark.parametrize("name", ["OpenGVLab/InternVL3-1B-hf", "OpenGVLab/InternVL3-78B-hf"])
def test_builtin_parameters_equal_transformers(name):
    """Tower + projector built at the built-in sizes on the meta device, against transformers'
    InternVLVisionModel + InternVLMultiModalProjector at the same config."""
    from transformers.models.internvl import modeling_internvl as m

    _, hf_config = get_builtin_config(name)
    config = transformers.InternVLConfig(vision_config=dict(hf_config["vision_config"]),
                                         text_config=dict(hf_config["text_config"], model_type="qwen2"))
    with torch.device("meta"):
        theirs = sum(p.numel() for mod in (m.InternVLVisionModel(config.vision_config),
                                           m.InternVLMultiModalProjector(config)) for p in mod.parameters())
    ours = sum(p.numel() for p in build_tower(name, load_format="dummy", device="meta").tower.parameters())
    print(f"{name}: {ours / 1e6:.1f}M parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs


# ---- processor ----

SIZES = [(448, 448), (300, 900), (900, 300), (1000, 1400), (33, 97), (1, 1), (2000, 500), (448, 896)]


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


def test_tile_grid_equals_transformers():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import get_optimal_tiled_canvas

    for h in (1, 100, 333, 448, 700, 1000, 2048):
        for w in (1, 57, 448, 640, 1333, 4000):
            for lo, hi in ((1, 12), (1, 6), (2, 40)):
                assert tile_grid(h, w, 448, lo, hi) == get_optimal_tiled_canvas((h, w), (448, 448), lo, hi), (h, w)


def _hf_kwargs():
    return dict(size={"height": 448, "width": 448}, crop_to_patches=True, min_patches=1, max_patches=12,
                image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225])


def _check_against(hf_processor, ours: InternVLProcessor):
    ims = _images()
    ref = hf_processor(images=ims, return_tensors="pt")
    pv, grid = ours(ims)
    assert grid[:, 0].tolist() == torch.as_tensor(ref["num_patches"]).tolist()
    assert (grid[:, 1:] == 32).all()
    tiles = pv.view(-1, 32, 32, 3, 14, 14).permute(0, 3, 1, 4, 2, 5).reshape(-1, 3, 448, 448)
    assert tiles.shape == ref["pixel_values"].shape
    level = 1 / 255 / min(0.229, 0.224, 0.225)  # one uint8 level after normalization
    err = (tiles - ref["pixel_values"]).abs().max().item()
    print(f"InternVL processor vs {type(hf_processor).__name__}: max abs diff {err:.2e} (1 uint8 level = {level:.3f})")
    assert err <= level


def test_processor_matches_transformers_pil():
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    ours = InternVLProcessor(InternVLProcessorConfig(backend="pil"))
    _check_against(GotOcr2ImageProcessorPil(**_hf_kwargs()), ours)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")
def test_processor_matches_transformers_default():
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor

    _check_against(GotOcr2ImageProcessor(**_hf_kwargs()), internvl_from_hf({}))


def test_processor_per_image_path_equals_batch_call():
    """The pipeline's per-image path (plan -> resize_one -> finish) gives the batch call's output."""
    proc = InternVLProcessor(InternVLProcessorConfig(backend="pil"))
    ims = _images()[:4]
    arrays = [torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous() for im in ims]
    plans = [proc.plan(a.shape[1], a.shape[2]) for a in arrays]
    pv, grid = proc.finish([proc.resize_one(a, p) for a, p in zip(arrays, plans)], plans)
    want_pv, want_grid = proc(ims)
    assert torch.equal(grid, want_grid) and torch.equal(pv, want_pv)
    assert sum(p.rows for p in plans) == pv.shape[0]


def test_bench_reference_equals_the_tower(six_b):
    """`mmenc bench`'s transformers side (tower + projector on a batch of equal tiles)."""
    from mmenc.bench.hf_reference import build_hf_tower

    folder, _ = six_b
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[3, 6, 6], [1, 6, 6]])
    pixels = ck.FAMILIES["InternVLForConditionalGeneration"].pixels(grid, seed=2).flatten(1)
    assert_close(build_hf_tower(loaded)(pixels, grid), run_tower(loaded, pixels, grid).embeddings,
                 "InternVL bench reference", TOL)


def test_encoder_end_to_end_one_embedding_per_image(six_b):
    """Encoder.encode: one tensor per image, 256 rows per tile (thumbnail included), tiles as
    transformers' processor counts them; equal to encode_pixels."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from mmenc import Encoder

    folder, _ = six_b
    enc = Encoder(str(folder), device="cpu", dtype="float32")
    ims = _images()[:4]
    out = enc.encode(ims)
    tiles = torch.as_tensor(GotOcr2ImageProcessorPil(**_hf_kwargs())(images=ims, return_tensors="pt")["num_patches"])
    assert [o.shape[0] for o in out] == (tiles * 256).tolist()
    assert_close(torch.cat(list(out)), enc.encode_pixels(*enc.preprocess(ims)), "encode vs encode_pixels", 1e-6)
