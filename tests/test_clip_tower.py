"""CLIP and LLaVA-1.5 specifics beyond the generic tower tests (their FAMILIES rows check parity on mixed
sizes, TP=2, data mode, built-ins and plan caching): pooled image embeddings (get_image_features,
pooler_output, image_embeds) for the three CLIP classes and their checkpoint layouts, the dense path at
the trained size, LLaVA's feature-layer selection (the unbuilt last layer, lists, the embeddings),
published checkpoint names, routing by vision_config.model_type, and the processors."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.engine.encoder import Encoder
from mmenc.engine.tower import build_tower, run_tower
from mmenc.preprocess.clip import clip_from_hf
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")

TOL = 1e-5
GRID = torch.tensor([[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 6, 6]])  # packed: several sizes, a 2-frame row
PIXELS = ck.FAMILIES["CLIPModel"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return ck.save_clip(tmp_path_factory.mktemp("clip"))


def test_pooled_matches_get_image_features(clip):
    folder, hf_model = clip
    pixels = PIXELS.pixels(GRID, seed=5)
    want = ck.hf_clip_pooled(hf_model, pixels, GRID)
    with Encoder(str(folder), device="cpu") as enc:
        got = enc.encode_pixels(pixels, GRID, pooled=True)
        empty = enc.encode_pixels(pixels[:0], GRID[:0], pooled=True)
    assert got.shape == (5, 24) and empty.shape == (0, 24)
    err = assert_close(got, want, "CLIP get_image_features", TOL)
    print(f"CLIP pooled: relative error {err:.2e} (tolerance {TOL:.0e})")


@pytest.mark.parametrize("cls,attr", [("CLIPVisionModel", "pooler_output"),
                                      ("CLIPVisionModelWithProjection", "image_embeds")])
@pytest.mark.parametrize("legacy_names", [False, True])
def test_vision_model_checkpoints(cls, attr, legacy_names, tmp_path):
    """The vision-only classes, as transformers 5 writes them and with transformers 4's vision_model.* names."""
    torch.manual_seed(0)
    model = ck._seeded(getattr(transformers, cls), transformers.CLIPVisionConfig(**ck.TINY_CLIP_VISION), 0)
    model.save_pretrained(tmp_path / "hf")
    folder = tmp_path / "hf"
    if legacy_names:
        def rename(tensors):
            return {(k if k.startswith(("vision_model.", "visual_")) else f"vision_model.{k}"): v
                    for k, v in tensors.items()}
        folder = ck.rewrite_checkpoint(folder, tmp_path / "legacy", rename)
    grid = torch.tensor([[1, 6, 6], [1, 4, 8]])
    pixels = PIXELS.pixels(grid, seed=2)
    with torch.no_grad():
        want = torch.cat([getattr(model(pixel_values=im, interpolate_pos_encoding=True), attr)
                          for im in ck.frame_images(pixels, grid, 8)])
    with Encoder(str(folder), device="cpu") as enc:
        got = enc.encode_pixels(pixels, grid, pooled=True)
    assert_close(got, want, f"{cls} {attr}", TOL)


def test_frames_at_the_trained_size_run_dense_without_interpolation(clip):
    folder, hf_model = clip
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[3, 6, 6]])
    plan = loaded.tower.plan(grid, "cpu")
    assert plan.dense and plan.pos_index is None and not loaded.tower.plan(GRID, "cpu").dense
    pixels = PIXELS.pixels(grid, seed=1)
    images = torch.cat(ck.frame_images(pixels, grid, 8))
    with torch.no_grad():
        want = hf_model.vision_model(pixel_values=images).last_hidden_state.reshape(-1, 32)
    assert_close(run_tower(loaded, pixels, grid).embeddings, want, "CLIP dense batch", TOL)


def test_gelu_tower(tmp_path):
    """OpenCLIP conversions with hidden_act "gelu" (exact erf)."""
    folder, hf_model = ck.save_clip(tmp_path, vision={"hidden_act": "gelu"})
    pixels = PIXELS.pixels(GRID, seed=4)
    got = run_tower(build_tower(str(folder), device="cpu"), pixels, GRID).embeddings
    assert_close(got, ck.hf_clip_outputs(hf_model, pixels, GRID)[0], "CLIP gelu", TOL)


@pytest.mark.parametrize("tower,layer,strategy", [("clip", -2, "default"), ("clip", [0, -1, 1], "full"),
                                                  ("siglip", -1, "default")])
def test_llava_feature_layers(tower, layer, strategy, tmp_path):
    folder, hf_model = ck.save_llava(tmp_path, tower=tower, feature_layer=layer, strategy=strategy)
    loaded = build_tower(str(folder), device="cpu")
    deepest = max(i % 4 for i in (layer if isinstance(layer, list) else [layer]))
    assert len(loaded.tower.encoder.layers) == deepest  # of 3: layers past the deepest taken are never built
    pixels = PIXELS.pixels(GRID, seed=6)
    want = ck.hf_llava_outputs(hf_model, pixels, GRID)[0]
    assert_close(run_tower(loaded, pixels, GRID).embeddings, want, f"LLaVA {tower} {layer} {strategy}", TOL)


def test_llava_published_names(tmp_path):
    """llava-hf checkpoints keep vision_tower.vision_model.* and the unused last layer / post_layernorm."""
    folder, hf_model = ck.save_llava(tmp_path / "hf")

    def published(tensors):
        return {k.replace("vision_tower.", "vision_tower.vision_model.", 1): v for k, v in tensors.items()}
    renamed = ck.rewrite_checkpoint(folder, tmp_path / "published", published)
    pixels = PIXELS.pixels(GRID, seed=7)
    got = run_tower(build_tower(str(renamed), device="cpu"), pixels, GRID).embeddings
    assert_close(got, ck.hf_llava_outputs(hf_model, pixels, GRID)[0], "LLaVA published names", TOL)


def test_llava_routing_and_errors(tmp_path):
    folder, _ = ck.save_llava(tmp_path)
    loaded = build_tower(str(folder), device="meta")
    assert type(loaded.tower).__name__ == "LlavaTower" and loaded.config.tower == "clip"
    with pytest.raises(ValueError, match="pooled=True.*has no pooled image embedding"):
        with Encoder(str(folder), device="cpu") as enc:
            enc.encode_pixels(PIXELS.pixels(GRID[:1]), GRID[:1], pooled=True)
    from mmenc.models.registry import get_model_spec

    config = {"architectures": ["LlavaForConditionalGeneration"], "vision_config": {"model_type": "dinov2"}}
    with pytest.raises(ValueError, match=r"model_type='dinov2'.*\['clip_vision_model', 'pixtral', "
                                         r"'siglip_vision_model'\]"):
        get_model_spec("LlavaForConditionalGeneration", config)
    assert get_model_spec("LlavaForConditionalGeneration", {"vision_config": {"model_type": "pixtral"}}).tower_cls \
        .__name__ == "PixtralVisionTower"
    from mmenc.models.llava import LlavaVisionConfig

    with pytest.raises(ValueError, match=r"vision_feature_layer=-5 is not a hidden-state index of a 3-layer tower"):
        LlavaVisionConfig.from_hf({"vision_config": ck.TINY_CLIP_VISION, "vision_feature_layer": -5})
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='cls'"):
        LlavaVisionConfig.from_hf({"vision_config": ck.TINY_CLIP_VISION, "vision_feature_select_strategy": "cls"})


# -- processors ---------------------------------------------------------------------------------------------
HAS_TV = importlib.util.find_spec("torchvision") is not None


def _images():
    rng = np.random.default_rng(0)
    sizes = [(33, 97), (97, 33), (224, 224), (500, 301), (1, 1), (28, 28), (12, 700), (400, 200)]
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    ims.append(Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8)))  # grayscale
    return ims


PROCESSORS = [  # (transformers class, its kwargs, the tower's patch size)
    ("clip", "CLIPImageProcessor", {}, 32),
    ("clip", "CLIPImageProcessor", {"size": {"shortest_edge": 336}, "crop_size": {"height": 336, "width": 336}}, 14),
    ("clip", "CLIPImageProcessor", {"size": {"shortest_edge": 200}, "crop_size": {"height": 224, "width": 224}}, 14),
    ("clip", "CLIPImageProcessor", {"do_center_crop": False}, 14),
    ("llava", "LlavaImageProcessor", {"do_pad": True, "size": {"shortest_edge": 336},
                                      "crop_size": {"height": 336, "width": 336}}, 14),
    ("siglip", "SiglipImageProcessor", {"size": {"height": 384, "width": 384}}, 14),
]


def _compare(hf, d, patch, backend):
    proc = clip_from_hf(d, backend=backend)
    for im in _images():
        ref = torch.as_tensor(np.asarray(hf(images=[im], return_tensors="pt")["pixel_values"][0]))
        pv, grid = proc([im])
        _, gh, gw = grid[0].tolist()
        assert (gh, gw) == (ref.shape[1] // patch, ref.shape[2] // patch), (im.size, grid.tolist(), ref.shape)
        image = pv.view(gh, gw, 3, patch, patch).permute(2, 0, 3, 1, 4).reshape(3, gh * patch, gw * patch)
        err = (image - ref[:, :gh * patch, :gw * patch]).abs().max().item()
        assert err == 0.0, f"{type(hf).__name__} {d} on {im.size}: max abs diff {err}"


@pytest.mark.parametrize("module,cls,cfg,patch", PROCESSORS, ids=[f"{c[1]}-{i}" for i, c in enumerate(PROCESSORS)])
def test_processor_matches_transformers_pil(module, cls, cfg, patch):
    mod = importlib.import_module(f"transformers.models.{module}.image_processing_pil_{module}")
    _compare(getattr(mod, f"{cls}Pil")(**cfg), {**cfg, "image_processor_type": cls, "patch_size": patch}, patch, "pil")


@pytest.mark.skipif(not HAS_TV, reason="transformers' default (torchvision) processors need torchvision")
@pytest.mark.parametrize("module,cls,cfg,patch", PROCESSORS, ids=[f"{c[1]}-{i}" for i, c in enumerate(PROCESSORS)])
def test_processor_matches_transformers_torchvision(module, cls, cfg, patch):
    mod = importlib.import_module(f"transformers.models.{module}.image_processing_{module}")
    _compare(getattr(mod, cls)(**cfg), {**cfg, "image_processor_type": cls, "patch_size": patch}, patch, "torchvision")


def test_processor_errors_name_the_value():
    with pytest.raises(ValueError, match=r"resample=0 is not supported"):
        clip_from_hf({"resample": 0})
    with pytest.raises(ValueError, match=r"smaller than one 14x14 patch"):
        clip_from_hf({"do_resize": False, "do_center_crop": False, "patch_size": 14}).plan(10, 300)
