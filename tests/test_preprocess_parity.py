"""Processors against transformers' own, built from kwargs (nothing downloaded).

backend="pil" is compared with transformers' *Pil classes (always available); the default
backend="torchvision" with transformers' torchvision classes, which need torchvision (skipped
without it). Tolerance: exact (max abs diff 0.0) for both; grids must be equal.
"""
import importlib.util
import itertools

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.preprocess import get_processor
from mmenc.preprocess.kimi import navit_resize
from mmenc.preprocess.qwen_vl import smart_resize, smart_resize_temporal
from mmenc.testing import version_before

HAS_TV = importlib.util.find_spec("torchvision") is not None
needs_tv = pytest.mark.skipif(not HAS_TV, reason="transformers' default (torchvision) processors need torchvision")
TOL = 0.0

SIZES = [(33, 97), (97, 33), (224, 224), (500, 301), (1, 1), (28, 28), (12, 700)]
QWEN3 = {"patch_size": 16, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "size": {"shortest_edge": 65536, "longest_edge": 16777216}}
GLM = {}  # transformers' Glm4vImageProcessor defaults


def _images():
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    ims.append(Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8)))  # grayscale
    ims.append(Image.fromarray(rng.integers(0, 256, (64, 48, 4), dtype=np.uint8)))  # RGBA
    ims.append(ims[0])  # a repeated size in the batch
    return ims


def _compare(hf_out, ours, key="pixel_values", grid="image_grid_thw"):
    pv, g = ours
    assert pv.dtype == torch.float32 and g.dtype == torch.int64
    assert torch.equal(g, hf_out[grid].to(torch.int64)), f"grid {g.tolist()} != {hf_out[grid].tolist()}"
    ref = hf_out[key]
    assert pv.shape == ref.shape, f"shape {tuple(pv.shape)} != {tuple(ref.shape)}"
    err = (pv - ref).abs().max().item()
    assert err <= TOL, f"max abs diff {err} > tolerance {TOL}"


def _hf(module, name):
    mod = importlib.import_module(f"transformers.models.{module}")
    return getattr(mod, name)


PIL_CASES = [
    ("qwen2_vl", "qwen2_vl", "Qwen2VLImageProcessorPil", {"min_pixels": 56 * 56, "max_pixels": 28 * 28 * 1280}),
    ("qwen2_5_vl", "qwen2_vl", "Qwen2VLImageProcessorPil", {"size": {"shortest_edge": 3136, "longest_edge": 200704}}),
    ("qwen3_vl", "qwen2_vl", "Qwen2VLImageProcessorPil", QWEN3),
    ("glm4v", "glm4v", "Glm4vImageProcessorPil", GLM),
]


@pytest.mark.parametrize("kind,module,cls,cfg", PIL_CASES, ids=[c[0] for c in PIL_CASES])
def test_pil_backend_matches_transformers_pil(kind, module, cls, cfg):
    ims = _images()
    hf = _hf(module, cls)(**cfg)
    _compare(hf(images=ims, return_tensors="pt"), get_processor(kind, cfg, backend="pil")(ims))


def test_default_backend_grid_equal_and_pixels_close_to_pil():
    """The two transformers backends differ by a few uint8 levels after a resize; ours reproduce that."""
    ims = _images()
    pv_tv, g_tv = get_processor("qwen2_vl")(ims)
    pv_pil, g_pil = get_processor("qwen2_vl", backend="pil")(ims)
    assert torch.equal(g_tv, g_pil)
    err = (pv_tv - pv_pil).abs().max().item()
    assert 0 < err < 0.5, f"torchvision vs pil max abs diff {err}, expected within (0, 0.5)"


def test_raw_inputs_same_as_pil(tmp_path):
    im = _images()[3]
    im.save(tmp_path / "x.png")
    a = get_processor("qwen2_vl")([im])
    b = get_processor("qwen2_vl")([tmp_path / "x.png", np.asarray(im)])
    assert torch.equal(torch.cat([a[0], a[0]]), b[0]) and b[1].shape == (2, 3)


TV_CASES = [
    ("qwen2_vl", "qwen2_vl", "Qwen2VLImageProcessor", {}),
    ("qwen3_vl", "qwen2_vl", "Qwen2VLImageProcessor", QWEN3),
    ("glm4v", "glm4v", "Glm4vImageProcessor", GLM),
    ("kimi_k25", "kimi_k25", "Kimi_K25ImageProcessor", {}),
    ("kimi_k25", "kimi_k25", "Kimi_K25ImageProcessor", {"max_patches": 300, "size": {"max_height": 20, "max_width": 20}}),
]


@needs_tv
@pytest.mark.parametrize("kind,module,cls,cfg", TV_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TV_CASES)])
def test_default_backend_matches_transformers_default(kind, module, cls, cfg):
    ims = _images()
    hf = _hf(module, cls)(**cfg)
    assert hf.backend == "torchvision"
    _compare(hf(images=ims, return_tensors="pt"), get_processor(kind, cfg)(ims))


VIDEO_CASES = [
    ("qwen2_vl", "qwen2_vl", "Qwen2VLVideoProcessor", {}, {}),
    ("qwen3_vl", "qwen3_vl", "Qwen3VLVideoProcessor", {"patch_size": 16, "image_mean": [0.5] * 3,
                                                       "image_std": [0.5] * 3}, {}),
    ("glm4v", "glm4v", "Glm4vVideoProcessor", {}, {"do_sample_frames": False}),
    ("kimi_k25", "kimi_k25", "Kimi_K25VideoProcessor", {}, {"do_sample_frames": False}),
]


@needs_tv
@pytest.mark.parametrize("n", [7, 30])
@pytest.mark.parametrize("kind,module,cls,cfg,call", VIDEO_CASES, ids=[c[0] for c in VIDEO_CASES])
def test_video_matches_transformers(kind, module, cls, cfg, call, n):
    rng = np.random.default_rng(n)
    frames = [Image.fromarray(rng.integers(0, 256, (45, 70, 3), dtype=np.uint8)) for _ in range(n)]
    hf = _hf(module, cls)(**cfg)
    out = hf(videos=[frames], return_tensors="pt", **call)
    _compare(out, get_processor(kind, cfg).preprocess_video(frames), "pixel_values_videos", "video_grid_thw")


def test_video_grid_and_padding_without_transformers():
    proc = get_processor("qwen2_vl")
    rng = np.random.default_rng(1)
    frames = [rng.integers(0, 256, (336, 336, 3), dtype=np.uint8) for _ in range(5)]  # no resize
    pv, g = proc.preprocess_video(frames)
    assert g.tolist() == [[3, 24, 24]]  # ceil(5 / 2) frames of 336/14 x 336/14 patches
    one, _ = proc([frames[0]])  # a still image == its frame duplicated temporal_patch_size times
    two, _ = proc.preprocess_video([frames[0], frames[0]])
    assert torch.equal(one, two)
    with pytest.raises(ValueError, match="differ in size"):
        proc.preprocess_video([frames[0], frames[0][:28]])


def test_resize_rules_match_transformers():
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize as glm_ref
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen_ref

    sides = [1, 13, 28, 29, 55, 97, 301, 1000, 4000]
    for h, w in itertools.product(sides, sides):
        if max(h, w) / min(h, w) > 200:
            continue
        assert smart_resize(h, w, 28, 3136, 1003520) == qwen_ref(h, w, 28, 3136, 1003520), (h, w)
        assert smart_resize_temporal(2, h, w, 2, 28, 12544, 11760000) == glm_ref(2, h, w, 2, 28, 12544, 11760000)
        (rh, rw), (ph, pw) = navit_resize(h, w, 14, 2, 16384, 512)
        assert ph % 28 == 0 and pw % 28 == 0 and rh <= h and rw <= w and ph - rh < 28 and pw - rw < 28
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(1, 300, 28, 3136, 1003520)


def test_from_hf_and_registry_errors():
    p = get_processor("Qwen2.5-VL", {"min_pixels": 100, "max_pixels": 5000, "size": {"shortest_edge": 1}})
    assert (p.config.min_pixels, p.config.max_pixels) == (100, 5000)  # min/max_pixels win over size
    assert get_processor("qwen3_vl").config.patch_size == 16
    with pytest.raises(ValueError, match="unknown processor kind 'dinov2'.*qwen2_vl"):
        get_processor("dinov2")
    with pytest.raises(ValueError, match="backend='cuda'"):
        get_processor("qwen2_vl", backend="cuda")
    with pytest.raises(ValueError, match="patch_size=0"):
        get_processor("glm4v", {"patch_size": 0})


# -- the parallel pipeline (mmenc.preprocess.pipeline) against transformers ---------------------------
def _pipeline(kind, cfg, device="cpu", **overrides):
    from mmenc.preprocess.pipeline import Preprocessor

    with Preprocessor(get_processor(kind, cfg, **overrides), device=device, workers=2) as pre:
        pv, grid, failures = pre.run(_images())
    assert failures == []
    return pv.cpu(), grid


def _report(kind, hf_out, ours, std):
    """Compare like _compare and print the max difference, also in uint8 levels (diff * 255 * std)."""
    _compare(hf_out, ours)
    err = (ours[0] - hf_out["pixel_values"]).abs().max().item()
    print(f"{kind}: pipeline vs transformers max abs diff {err} ({err * 255 * max(std):.3f} uint8 levels)")


@pytest.mark.parametrize("kind,module,cls,cfg", PIL_CASES, ids=[c[0] for c in PIL_CASES])
def test_pipeline_matches_transformers_pil(kind, module, cls, cfg):
    hf = _hf(module, cls)(**cfg)
    _report(kind, hf(images=_images(), return_tensors="pt"), _pipeline(kind, cfg, backend="pil"), hf.image_std)


@needs_tv
@pytest.mark.parametrize("kind,module,cls,cfg", TV_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TV_CASES)])
def test_pipeline_matches_transformers_default(kind, module, cls, cfg):
    hf = _hf(module, cls)(**cfg)
    _report(kind, hf(images=_images(), return_tensors="pt"), _pipeline(kind, cfg), hf.image_std)


@pytest.mark.gpu
@needs_tv
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.xfail(version_before(torch.__version__, "2.13"), strict=False,
                   reason="on the H200 host (torch 2.11, torchvision 0.26) the GPU resize differed from that host's CPU "
                          "uint8 kernel on these uniform-noise images by up to 3.7 (normalised; run 9c) while it matched "
                          "the CPU kernel of torch 2.13 here and transformers exactly on photographic JPEGs (bench "
                          "--e2e, run 9a); cause not confirmed (kernel version or CPU dispatch), see docs/preprocessing.md")
@pytest.mark.parametrize("kind,module,cls,cfg", TV_CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(TV_CASES)])
def test_pipeline_on_cuda_matches_transformers_default_on_cpu(kind, module, cls, cfg):
    """Resize (exact uint8 kernel) and normalize on the GPU: still transformers' CPU output, bit for bit."""
    hf = _hf(module, cls)(**cfg)
    _report(kind, hf(images=_images(), return_tensors="pt"), _pipeline(kind, cfg, device="cuda"), hf.image_std)
