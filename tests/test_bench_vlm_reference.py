"""`mmenc bench`'s transformers side for the LLaVA-style families (mmenc/bench/hf_vlm.py): the whole VLM with a
one-layer language model, get_image_features batched as transformers' processor output is, equals mmenc's tower,
from a checkpoint folder and with dummy weights. LLaVA over Pixtral keeps its own reference (hf_projected)."""
import pytest
import torch

from mmenc.bench.hf_reference import build_hf_tower, hf_tower_available, vision_model_type
from mmenc.bench.hf_vlm import VLMReference
from mmenc.engine.tower import build_tower, run_tower
from mmenc.testing import checkpoints as ck

FAMILIES = ["LlavaForConditionalGeneration+clip", "LlavaForConditionalGeneration+siglip",
            "VipLlavaForConditionalGeneration", "LlavaNextForConditionalGeneration",
            "LlavaOnevisionForConditionalGeneration", "AyaVisionForConditionalGeneration",
            "Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"]


def _grid(case) -> torch.Tensor:
    rows = [list(r) for r in case.grid] if case.grid is not None else [[1, 4, 6], [1, 8, 2]]
    return torch.tensor(rows + [rows[0]])  # a repeated row: frames / tiles of one size share a call


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {key: ck.FAMILIES[key].save(tmp_path_factory.mktemp(key.replace("+", "_")))[0] for key in FAMILIES}


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
@pytest.mark.parametrize("key", FAMILIES)
def test_bench_reference_equals_the_tower(key, load_format, folders):
    case = ck.FAMILIES[key]
    loaded = build_tower(str(folders[key]), device="cpu", load_format=load_format)
    architecture = loaded.hf_config["architectures"][0]
    assert hf_tower_available(architecture, vision_model_type(loaded.hf_config)) is None
    hf = build_hf_tower(loaded)  # dummy: the mmenc tower now holds transformers' random weights
    assert isinstance(hf, VLMReference)
    text = hf.module.config.text_config
    assert text.num_hidden_layers == 1 and (load_format == "auto" or text.vocab_size <= 1024)
    grid = _grid(case)
    pixels = case.pixels(grid, seed=1).flatten(1)  # the bench's flat rows
    want = run_tower(loaded, pixels, grid).embeddings
    got = hf(pixels, grid)
    assert got.shape == want.shape and want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_llava_over_pixtral_keeps_its_reference():
    from mmenc.bench.hf_vlm import vlm_family

    assert vlm_family("LlavaForConditionalGeneration", "pixtral") is None
    assert vlm_family("LlavaForConditionalGeneration", "clip_vision_model") is not None
    assert hf_tower_available("LlavaForConditionalGeneration", "pixtral") is None  # hf_projected's Pixtral + projector


# preprocessor configs at the tiny towers' 48 px (transformers' processor and mmenc's read the same file)
PROCESSOR_CONFIGS = {
    "LlavaForConditionalGeneration+clip": {"image_processor_type": "CLIPImageProcessor", "size": {"shortest_edge": 48},
                                           "crop_size": {"height": 48, "width": 48}},
    "LlavaNextForConditionalGeneration": {"image_processor_type": "LlavaNextImageProcessor",
                                          "size": {"shortest_edge": 48}, "crop_size": {"height": 48, "width": 48},
                                          "image_grid_pinpoints": ck.TINY_NEXT_PINPOINTS},
    # no preprocessor_config.json, as a built-in name: both processors from the tower's processor_defaults()
    "LlavaOnevisionForConditionalGeneration": None,
}


def _rows(pixel_values: torch.Tensor, grid: torch.Tensor, patch: int) -> torch.Tensor:
    """transformers' processor output ([N, tiles, C, H, W] zero-padded, or [N, C, H, W]) as mmenc's patch rows."""
    images = pixel_values if pixel_values.dim() == 5 else pixel_values[:, None]
    rows = []
    for image, (t, h, w, *_) in zip(images, grid.tolist()):
        rows.append(image[:t].reshape(t, -1, h, patch, w, patch).permute(0, 2, 4, 1, 3, 5).reshape(t * h * w, -1))
    return torch.cat(rows)


@pytest.mark.parametrize("key", list(PROCESSOR_CONFIGS))
def test_e2e_rows_run_transformers_on_its_processor_output(key, tmp_path):
    """--e2e: transformers' rows call get_image_features on its own processor's output (tiles with image_sizes
    for LLaVA-NeXT, whole images for LLaVA-1.5); that equals mmenc's tower on the same pixels (the two
    processors' pixels differ slightly where transformers lacks torchvision: its PIL resize)."""
    import json

    import numpy as np
    from PIL import Image

    from mmenc import Encoder
    from mmenc.bench import e2e

    folder, _ = ck.FAMILIES[key].save(tmp_path / "ckpt")
    if PROCESSOR_CONFIGS[key] is not None:
        (folder / "preprocessor_config.json").write_text(json.dumps(PROCESSOR_CONFIGS[key]))
    rng = np.random.default_rng(0)
    paths = []
    for i, (h, w) in enumerate([(40, 90), (100, 100), (150, 30)]):
        paths.append(str(tmp_path / f"{i}.png"))
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
    images = [Image.open(p).convert("RGB") for p in paths]
    with Encoder(str(folder), device="cpu") as enc:
        hf = build_hf_tower(enc.loaded)
        hf_proc = e2e.hf_image_processor(enc.loaded.hf_config["model_type"], enc.loaded.processor_settings,
                                         tmp_path / "hf")
        assert e2e.hf_rows_unavailable(hf_proc, paths[:1], hf) is None
        out = hf_proc(images=images, return_tensors="pt")
        _, grid = enc.preprocess(images)
        if "image_sizes" in out:
            assert out["image_sizes"].tolist() == grid[:, 3:].tolist()
        want = enc.encode_pixels(_rows(out["pixel_values"], grid, hf.module.config.vision_config.patch_size), grid)
        got = hf.from_processor(out)
        rows, summary = e2e.run_workload("w", enc, paths, hf_proc, hf, warmup=0, iters=1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "transformers_skipped" not in summary
    assert [r.impl for r in rows if r.impl.startswith("transformers")] == ["transformers proc+tower",
                                                                          "transformers proc only"]


def test_compiled_peer_compiles_get_image_features(folders):
    """`--hf-compile`: get_image_features itself goes under torch.compile (torch.compile of the model would leave
    model.model.get_image_features eager); the eager reference is left as it is. (Not run here: an Inductor
    CPU compile of it takes ~45 s on 2 cores; `mmenc bench --hf-compile` on this tiny checkpoint ran it by hand.)"""
    from mmenc.cli.bench import compiled_peer

    loaded = build_tower(str(folders["LlavaForConditionalGeneration+clip"]), device="cpu")
    hf = build_hf_tower(loaded)
    peer = compiled_peer(hf)
    assert peer.module is hf.module and peer.options == hf.options
    assert peer._image_features._torchdynamo_orig_callable == hf.module.model.get_image_features
    assert hf._image_features == hf.module.model.get_image_features  # not compiled
