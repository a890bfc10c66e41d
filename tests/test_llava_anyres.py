"""LLaVA-NeXT and LLaVA-OneVision specifics beyond the generic tower tests (their FAMILIES rows check
get_image_features parity on images of several canvases in one call, TP=2, data mode, built-ins, plan
caching): untiled images (three-column rows), the published checkpoint names, grid rows that do not fit
the image size, the geometry against transformers' own functions, Encoder.encode on image files, and the
processors against transformers' PIL classes (the torchvision ones where torchvision imports)."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.anyres import select_best_resolution, unpadded_region
from mmenc.engine.encoder import Encoder
from mmenc.engine.tower import build_tower, run_tower
from mmenc.preprocess.anyres import llava_next_from_hf, llava_onevision_from_hf
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")

TOL = 1e-5
NEXT = ck.FAMILIES["LlavaNextForConditionalGeneration"]
ONEVISION = ck.FAMILIES["LlavaOnevisionForConditionalGeneration"]


@pytest.fixture(scope="module")
def onevision(tmp_path_factory):
    return ck.save_llava_anyres(tmp_path_factory.mktemp("onevision"), onevision=True)


def test_untiled_images_are_tokens_and_a_newline(onevision):
    """(t, h, w) rows: t images of one tile each, as OneVision's multi-image prompts (batch_num_images > 1)."""
    folder, model = onevision
    grid = torch.tensor([[2, 6, 6]])
    pixels = ONEVISION.pixels(grid, seed=2)
    images = torch.cat(ck.frame_images(pixels, grid, 8))[:, None]  # [2, 1, C, 48, 48]
    with torch.no_grad():
        want = model.model.get_image_features(pixel_values=images, image_sizes=torch.tensor([[48, 48]] * 2),
                                              vision_feature_layer=-1, vision_feature_select_strategy="full",
                                              batch_num_images=torch.tensor([2])).pooler_output
    loaded = build_tower(str(folder), device="cpu")
    assert loaded.output_tokens(grid) == [2 * 37]
    assert_close(run_tower(loaded, pixels, grid).embeddings, torch.cat(want), "OneVision untiled", TOL)


def test_published_names(tmp_path):
    """llava-hf checkpoints: vision_tower.vision_model.*, image_newline at the top level."""
    folder, model = ck.save_llava_anyres(tmp_path / "hf")
    renamed = ck.rewrite_checkpoint(folder, tmp_path / "published", lambda tensors: {
        k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()})
    grid = torch.tensor(NEXT.grid)
    pixels = NEXT.pixels(grid, seed=4)
    got = run_tower(build_tower(str(renamed), device="cpu"), pixels, grid).embeddings
    assert_close(got, ck.hf_anyres_outputs(model, pixels, grid)[0], "LLaVA-NeXT published names", TOL)


def test_grid_rows_must_fit_the_image(tmp_path):
    folder, _ = ck.save_llava_anyres(tmp_path)
    loaded = build_tower(str(folder), device="meta")
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(2, 6, 6, 100, 100\): an anyres image of width=100 height=100 is "
                                         r"\(5, 6, 6, 100, 100\)"):
        loaded.output_tokens(torch.tensor([[2, 6, 6, 100, 100]]))
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(5, 4, 4, 100, 100\)"):
        loaded.output_tokens(torch.tensor([[5, 4, 4, 100, 100]]))
    from mmenc.models.llava import LlavaVisionConfig

    config = {"model_type": "llava_next", "vision_config": ck.TINY_CLIP_VISION,
              "image_grid_pinpoints": ck.TINY_NEXT_PINPOINTS}
    with pytest.raises(ValueError, match=r"'full' with a clip tower leaves one more token"):
        LlavaVisionConfig.from_hf({**config, "vision_feature_select_strategy": "full"})
    with pytest.raises(ValueError, match=r"multiples of the tile size 48"):
        LlavaVisionConfig.from_hf({**config, "image_grid_pinpoints": [[48, 100]]})


@pytest.mark.parametrize("height,width", [(40, 90), (90, 40), (100, 100), (47, 300), (1000, 7), (1, 1)])
def test_geometry_equals_transformers(height, width):
    from transformers.image_processing_utils import select_best_resolution as hf_best
    from transformers.models.llava_next.modeling_llava_next import unpad_image

    pinpoints = [[336 * a, 336 * b] for a in range(1, 4) for b in range(1, 4)]
    assert select_best_resolution(height, width, pinpoints) == tuple(hf_best((height, width), pinpoints))
    rows, cols = 24 * 3, 24 * 2
    canvas = torch.arange(rows * cols).view(1, rows, cols)
    kept = unpad_image(canvas, (height, width))
    top, left, kr, kc = unpadded_region(height, width, rows, cols)
    assert torch.equal(kept, canvas[:, top:top + kr, left:left + kc])


def test_encode_image_files(tmp_path):
    """Encoder.encode on files of several sizes: five-column grids through the pipeline, one result per image."""
    folder, model = ck.save_llava_anyres(tmp_path / "ckpt")
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(40, 90), (100, 100), (150, 30)]):
        paths.append(tmp_path / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    with Encoder(str(folder), device="cpu") as enc:
        pixels, grid = enc.preprocess([str(p) for p in paths])
        got = enc.encode([str(p) for p in paths])
    assert grid.shape == (3, 5) and grid[:, 3:].tolist() == [[40, 90], [100, 100], [150, 30]]
    want = ck.hf_anyres_outputs(model, pixels, grid)[0].split(enc.output_tokens(grid))
    for i, (g, w) in enumerate(zip(got, want)):
        assert_close(g, w, f"image {i}", TOL)


HAS_TV = importlib.util.find_spec("torchvision") is not None
PROCESSORS = [  # (module, class, kwargs, tower patch)
    ("llava_next", "LlavaNextImageProcessor", {"size": {"shortest_edge": 336},
                                               "crop_size": {"height": 336, "width": 336}}, 14),
    ("llava_next", "LlavaNextImageProcessor", {"size": {"shortest_edge": 48}, "crop_size": {"height": 48, "width": 48},
                                               "image_grid_pinpoints": ck.TINY_NEXT_PINPOINTS}, 8),
    ("llava_onevision", "LlavaOnevisionImageProcessor", {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}, 14),
]


def _compare(hf, fn, cfg, patch, backend):
    rng = np.random.default_rng(1)
    proc = fn({**cfg, "patch_size": patch}, backend=backend)
    for h, w in [(33, 97), (97, 33), (500, 301), (1, 1), (12, 700), (336, 336), (1000, 700)]:
        im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        out = hf(images=[im], return_tensors="pt")
        pv, grid = proc([im])
        tiles, s, _, height, width = grid[0].tolist()
        assert (height, width) == tuple(out["image_sizes"][0].tolist()) and out["pixel_values"].shape[1] == tiles
        ref = torch.as_tensor(np.asarray(out["pixel_values"][0]))[:, :, :s * patch, :s * patch]
        got = pv.view(tiles, s, s, 3, patch, patch).permute(0, 3, 1, 4, 2, 5).reshape(ref.shape)
        err = (got - ref).abs().max().item()
        assert err == 0.0, f"{type(hf).__name__} on {h}x{w}: max abs diff {err}"


@pytest.mark.parametrize("module,cls,cfg,patch", PROCESSORS, ids=[f"{c[1]}-{i}" for i, c in enumerate(PROCESSORS)])
def test_processor_matches_transformers_pil(module, cls, cfg, patch):
    mod = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    fn = llava_onevision_from_hf if "onevision" in module else llava_next_from_hf
    _compare(getattr(mod, f"{cls}Pil")(**cfg), fn, cfg, patch, "pil")


@pytest.mark.skipif(not HAS_TV, reason="transformers' default (torchvision) processors need torchvision")
@pytest.mark.parametrize("module,cls,cfg,patch", PROCESSORS, ids=[f"{c[1]}-{i}" for i, c in enumerate(PROCESSORS)])
def test_processor_matches_transformers_torchvision(module, cls, cfg, patch):
    mod = importlib.import_module(f"transformers.models.{module}.image_processing_{module}")
    fn = llava_onevision_from_hf if "onevision" in module else llava_next_from_hf
    _compare(getattr(mod, cls)(**cfg), fn, cfg, patch, "torchvision")
