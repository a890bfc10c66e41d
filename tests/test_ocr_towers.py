"""The OCR-lineage towers (GLM-OCR, PaddleOCR-VL, ERNIE-4.5-VL, HunyuanOCR): their processors against
transformers' (PIL classes here; the torchvision ones where torchvision is importable), their
tensor-parallel and data modes in one spawn, and their family-specific math. Parity with transformers'
towers is in tests/test_towers_generic.py (their FAMILIES rows)."""
import importlib
import importlib.util

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from PIL import Image

from mmenc.engine.runner import build_tower, run_tower
from mmenc.preprocess import get_processor
from mmenc.testing import checkpoints as ck
from mmenc.testing.spmd import check_modes_match, free_port

pytest.importorskip("transformers")

HAS_TV = importlib.util.find_spec("torchvision") is not None
SIZES = [(33, 97), (97, 33), (224, 224), (500, 301), (28, 28), (12, 700), (700, 40), (1100, 900)]
OCR_ARCHS = ["GlmOcrForConditionalGeneration", "PaddleOCRVLForConditionalGeneration",
             "Ernie4_5_VLMoeForConditionalGeneration", "HunYuanVLForConditionalGeneration"]
GRID = torch.tensor([[1, 2, 2], [1, 6, 10], [1, 8, 6], [1, 10, 4]])


def _images():
    rng = np.random.default_rng(0)
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    ims.append(Image.fromarray(rng.integers(0, 256, (40, 60), dtype=np.uint8)))  # grayscale
    return ims


# (mmenc kind, transformers module, class stem, processor kwargs): kwargs as a checkpoint's file would hold
CASES = [
    ("glm_ocr", "glm46v", "Glm46VImageProcessor", {}),
    ("glm_ocr", "glm46v", "Glm46VImageProcessor", {"size": {"shortest_edge": 12544, "longest_edge": 200000}}),
    ("paddleocr_vl", "paddleocr_vl", "PaddleOCRVLImageProcessor", {}),
    ("paddleocr_vl", "paddleocr_vl", "PaddleOCRVLImageProcessor",
     {"min_pixels": 147384, "max_pixels": 200000, "image_mean": [0.5] * 3, "image_std": [0.5] * 3}),
    ("ernie4_5_vl_moe", "ernie4_5_vl_moe", "Ernie4_5_VLMoeImageProcessor", {}),
    ("ernie4_5_vl_moe", "ernie4_5_vl_moe", "Ernie4_5_VLMoeImageProcessor",
     {"size": {"shortest_edge": 3136, "longest_edge": 100000}}),
    ("hunyuan_vl", "hunyuan_vl", "HunYuanVLImageProcessor", {}),
    ("hunyuan_vl", "hunyuan_vl", "HunYuanVLImageProcessor", {"min_pixels": 65536, "max_pixels": 300000}),
]


def _hf_processor(module: str, stem: str, cfg: dict, pil: bool):
    mod = importlib.import_module(f"transformers.models.{module}")
    return getattr(mod, stem + ("Pil" if pil else ""))(**cfg)


def _compare(kind, hf_out, ours, tol):
    pv, grid = ours
    assert torch.equal(grid, hf_out["image_grid_thw"].to(torch.int64)), \
        f"{kind}: grid {grid.tolist()} != transformers' {hf_out['image_grid_thw'].tolist()}"
    ref = hf_out["pixel_values"]
    assert pv.shape == ref.shape, f"{kind}: pixel_values {tuple(pv.shape)} != transformers' {tuple(ref.shape)}"
    err = (pv - ref).abs().max().item()
    print(f"{kind}: max abs diff {err} (tolerance {tol})")
    assert err <= tol, f"{kind}: pixel_values max abs diff {err} > tolerance {tol}"


@pytest.mark.parametrize("kind,module,stem,cfg", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_processor_matches_transformers_pil(kind, module, stem, cfg):
    hf = _hf_processor(module, stem, cfg, pil=True)
    _compare(kind, hf(images=_images(), return_tensors="pt"), get_processor(kind, cfg, backend="pil")(_images()), 0.0)


@pytest.mark.skipif(not HAS_TV, reason="transformers' default (torchvision) processors need torchvision")
@pytest.mark.parametrize("kind,module,stem,cfg", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_processor_matches_transformers_default(kind, module, stem, cfg):
    hf = _hf_processor(module, stem, cfg, pil=False)
    # one uint8 level after normalisation at most (the brief's bound); in practice exact
    _compare(kind, hf(images=_images(), return_tensors="pt"), get_processor(kind, cfg)(_images()),
             1.0 / 255 / min(hf.image_std))


@pytest.mark.parametrize("kind", ["paddleocr_vl", "hunyuan_vl", "ernie4_5_vl_moe", "glm_ocr"])
def test_pipeline_equals_call(kind):
    """The per-image pipeline (plan -> resize_one -> finish) gives what __call__ gives."""
    from mmenc.preprocess.pipeline import Preprocessor

    proc = get_processor(kind, backend="pil")
    want_pv, want_grid = proc(_images())
    with Preprocessor(proc, workers=2) as pre:
        pv, grid, failures = pre.run(_images())
    assert failures == [] and torch.equal(grid, want_grid), f"{kind}: grid {grid.tolist()} != {want_grid.tolist()}"
    assert pv.shape == want_pv.shape and torch.equal(pv, want_pv), f"{kind}: pipeline pixels differ from __call__"


@pytest.mark.parametrize("kind", ["paddleocr_vl", "hunyuan_vl"])
def test_image_only_processors_refuse_video(kind):
    with pytest.raises(ValueError, match="images only"):
        get_processor(kind).preprocess_video([np.zeros((56, 56, 3), dtype=np.uint8)] * 2)


def test_parallel_modes_equal_one_process(tmp_path):
    """TP=2 ("weights") and data mode over 2 gloo ranks equal one process, for every OCR family
    transformers can write here (GLM-OCR's 2 heads split 1 + 1)."""
    cases = []
    for arch in OCR_ARCHS:
        case = ck.FAMILIES.get(arch)
        if case is None:
            continue
        try:
            folder, _ = case.save(tmp_path / arch)
        except ImportError:
            continue
        pixels = case.pixels(GRID, seed=5)
        cases.append((str(folder), pixels, GRID, run_tower(build_tower(str(folder), device="cpu"), pixels, GRID)))
    assert cases, "no OCR family could be written by this transformers"
    mp.spawn(check_modes_match, args=(2, free_port(), cases), nprocs=2, join=True)
