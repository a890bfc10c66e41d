"""Pixtral's own math beyond the generic table: the axial rotary frequencies and the Mistral3 patch
merger's unfold order against transformers' modules, what the config refuses, built-in sizes against
transformers' parameter counts, and the processor (Pixtral-12B and Mistral3's merge multiple)
against transformers' PixtralImageProcessor."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.engine.tower import build_tower
from mmenc.layers.rotary import VisionRotary2D
from mmenc.models.pixtral import MergingLayer, PixtralVisionConfig
from mmenc.models.registry import get_builtin_config
from mmenc.preprocess.pixtral import PixtralProcessor, PixtralProcessorConfig, mistral3_from_hf, pixtral_from_hf
from mmenc.testing.compare import assert_close

transformers = pytest.importorskip("transformers")


def test_rotary_tables_equal_transformers():
    from transformers.models.pixtral import modeling_pixtral as m

    config = transformers.PixtralVisionConfig(hidden_size=64, num_attention_heads=2, image_size=320, patch_size=16)
    hf = m.PixtralVisionRotaryEmbedding(config)
    h, w = 7, 12
    rows, cols = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    want_cos, want_sin = hf(torch.zeros(1, dtype=torch.float32), torch.stack([rows.flatten(), cols.flatten()], -1))
    cos, sin = VisionRotary2D(32, 10000.0, axis_freqs="alternate").tables(((1, h, w),))
    assert_close(cos, want_cos, "Pixtral rotary cos", 1e-6)
    assert_close(sin, want_sin, "Pixtral rotary sin", 1e-6)


def test_merging_layer_equals_mistral3_patch_merger():
    """transformers unfolds each 2x2 block channel-major; mmenc concatenates the block's patches and
    permutes the weight's columns at load: the same result."""
    from transformers.models.mistral3 import modeling_mistral3 as m

    config = transformers.Mistral3Config(vision_config={"hidden_size": 8, "patch_size": 14, "num_attention_heads": 2},
                                         text_config={"hidden_size": 16, "num_attention_heads": 2})
    torch.manual_seed(0)
    hf = m.Mistral3PatchMerger(config)
    h, w, d = 4, 6, 8
    feats = torch.randn(h * w, d)  # raster order
    with torch.no_grad():
        want = hf(feats, torch.tensor([[h * 14, w * 14]]))
    ours = MergingLayer(d, 2)
    ours.weight.weight_loader(ours.weight, hf.merging_layer.weight.detach())
    blocks = feats.view(h // 2, 2, w // 2, 2, d).permute(0, 2, 1, 3, 4).reshape(-1, 4 * d)  # merge-block order
    assert_close(ours(blocks), want, "patch merger", 1e-6)


def test_config_reads_both_projectors_and_refuses_the_rest():
    mistral3 = PixtralVisionConfig.from_hf(get_builtin_config("mistralai/Mistral-Small-3.1-24B-Instruct-2503")[1])
    assert (mistral3.projector, mistral3.spatial_merge_size, mistral3.patch_size, mistral3.projector_bias) == \
        ("mistral3", 2, 14, False)
    llava = PixtralVisionConfig.from_hf(get_builtin_config("mistralai/Pixtral-12B-2409")[1])
    assert (llava.projector, llava.spatial_merge_size, llava.patch_size, llava.projector_bias) == ("llava", 1, 16, True)
    clip = {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "vision_config": {"model_type": "clip_vision_model"}}
    with pytest.raises(ValueError, match=r"model_type='clip_vision_model'"):
        PixtralVisionConfig.from_hf(clip)
    with pytest.raises(ValueError, match=r"vision_feature_select_strategy='default'"):
        PixtralVisionConfig.from_hf({**clip, "vision_config": {"model_type": "pixtral"}})
    with pytest.raises(ValueError, match=r"vision_feature_layer=\[-1, -2\]"):
        PixtralVisionConfig.from_hf({"architectures": ["Mistral3ForConditionalGeneration"],
                                     "vision_config": {"model_type": "pixtral"}, "vision_feature_layer": [-1, -2]})


@pytest.mark.parametrize("name", ["mistralai/Pixtral-12B-2409", "mistralai/Mistral-Small-3.1-24B-Instruct-2503",
                                  "mistralai/Pixtral-Large-Instruct-2411"])
def test_builtin_parameters_equal_transformers(name):
    """Tower + projector at the built-in sizes (meta device) against transformers' PixtralVisionModel +
    the projector of its architecture."""
    from transformers.models.llava import modeling_llava
    from transformers.models.mistral3 import modeling_mistral3

    _, hf_config = get_builtin_config(name)
    top = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type", "torch_dtype")}
    if hf_config["model_type"] == "llava":
        config = transformers.LlavaConfig(**top)
        projector = modeling_llava.LlavaMultiModalProjector
    else:
        config = transformers.Mistral3Config(**top)
        projector = modeling_mistral3.Mistral3MultiModalProjector
    with torch.device("meta"):
        theirs = sum(p.numel() for mod in (transformers.PixtralVisionModel(config.vision_config), projector(config))
                     for p in mod.parameters())
    ours = sum(p.numel() for p in build_tower(name, load_format="dummy", device="meta").tower.parameters())
    print(f"{name}: {ours / 1e6:.1f}M parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs


# ---- processor ----

SIZES = [(33, 97), (97, 33), (224, 224), (1100, 700), (700, 2100), (1, 1), (16, 16), (500, 301)]


def _images():
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return ims + [ims[0]]


def _check_against(hf_processor, ours: PixtralProcessor, patch: int, multiple: int):
    """transformers pads the batch to its largest image; ours packs: compare each image's valid region."""
    ims = _images()
    ref = hf_processor(images=ims, return_tensors="pt", patch_size={"height": multiple, "width": multiple})
    pv, grid = ours(ims)
    sizes = [tuple(int(v) for v in s) for s in ref["image_sizes"]]
    assert [(h * patch, w * patch) for _, h, w in grid.tolist()] == sizes
    assert all(h % multiple == 0 and w % multiple == 0 for h, w in sizes)
    level = 1 / 255 / min(ours.config.image_std)  # one uint8 level after normalization
    worst = 0.0
    for i, (patches, (h, w)) in enumerate(zip(pv.split([h * w // patch ** 2 for h, w in sizes]), sizes)):
        image = patches.view(h // patch, w // patch, 3, patch, patch).permute(2, 0, 3, 1, 4).reshape(3, h, w)
        worst = max(worst, (image - ref["pixel_values"][i, :, :h, :w]).abs().max().item())
    print(f"Pixtral processor (multiple {multiple}) vs {type(hf_processor).__name__}: max abs diff {worst:.2e}")
    assert worst <= level


def test_processor_matches_transformers_pil():
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    _check_against(PixtralImageProcessorPil(), pixtral_from_hf({}, backend="pil"), 16, 16)


def test_mistral3_processor_resizes_to_patch_times_merge():
    """PixtralProcessor hands the image processor patch_size * spatial_merge_size (14 * 2)."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    ours = mistral3_from_hf({"patch_size": {"height": 14, "width": 14}, "size": {"longest_edge": 1540}},
                            backend="pil")
    assert (ours.config.patch_size, ours.config.multiple) == (14, 28)
    _check_against(PixtralImageProcessorPil(size={"longest_edge": 1540}), ours, 14, 28)


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")
def test_processor_matches_transformers_default():
    _check_against(transformers.PixtralImageProcessor(), pixtral_from_hf({}), 16, 16)


def test_processor_per_image_path_equals_batch_call():
    proc = PixtralProcessor(PixtralProcessorConfig(backend="pil", longest_edge=512))
    ims = _images()[:5]
    arrays = [torch.from_numpy(np.array(im)).permute(2, 0, 1).contiguous() for im in ims]
    plans = [proc.plan(a.shape[1], a.shape[2]) for a in arrays]
    pv, grid = proc.finish([proc.resize_one(a, p) for a, p in zip(arrays, plans)], plans)
    want_pv, want_grid = proc(ims)
    assert torch.equal(grid, want_grid) and torch.equal(pv, want_pv)
    assert max(max(h, w) for _, h, w in grid.tolist()) * 16 <= 512 + 15


@pytest.mark.parametrize("arch", ["Mistral3ForConditionalGeneration", "LlavaForConditionalGeneration"])
def test_bench_reference_equals_the_tower(arch, tmp_path):
    """`mmenc bench`'s transformers side (tower + projector on padded images) on a tiny checkpoint."""
    from mmenc.bench.hf_reference import build_hf_tower, hf_tower_available
    from mmenc.engine.tower import run_tower
    from mmenc.testing import checkpoints as ck

    case = ck.FAMILIES[arch]
    folder, _ = case.save(tmp_path)
    loaded = build_tower(str(folder), device="cpu")
    assert hf_tower_available(arch) is None
    grid = torch.tensor([[1, 4, 6], [1, 8, 2], [1, 2, 2]])
    pixels = case.pixels(grid, seed=1).flatten(1)  # the bench's flat rows
    assert_close(build_hf_tower(loaded)(pixels, grid), run_tower(loaded, pixels, grid).embeddings,
                 f"{arch}: bench reference", 1e-5)


def test_encoder_end_to_end_one_embedding_per_image(tmp_path):
    """Encoder.encode on images of different sizes: one tensor per image, (h/28)*(w/28) rows for the
    sizes transformers' processor picks (Mistral3: patch 14, merge 2), equal to encode_pixels."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from mmenc import Encoder
    from mmenc.testing import checkpoints as ck

    folder, _ = ck.save_pixtral(tmp_path)
    enc = Encoder(str(folder), device="cpu", dtype="float32")
    ims = _images()[:4]
    out = enc.encode(ims)
    sizes = PixtralImageProcessorPil(size={"longest_edge": 1540})(images=ims, patch_size={"height": 28, "width": 28},
                                                                  return_tensors="pt")["image_sizes"]
    assert [o.shape[0] for o in out] == [int(h) // 28 * (int(w) // 28) for h, w in sizes]
    flat = enc.encode_pixels(*enc.preprocess(ims))
    assert_close(torch.cat(list(out)), flat, "encode vs encode_pixels", 1e-6)
