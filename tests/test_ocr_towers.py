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

from mmenc.engine.tower import build_tower, run_tower
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


def _meta_parameters(*modules_and_configs) -> int:
    with torch.device("meta"):
        return sum(p.numel() for cls, cfg in modules_and_configs for p in cls(cfg).parameters())


@pytest.mark.parametrize("name", ["PaddlePaddle/PaddleOCR-VL", "baidu/ERNIE-4.5-VL-424B-A47B-PT", "tencent/HunyuanOCR"])
def test_builtin_parameter_count_equals_transformers(name):
    """Built-in sizes: mmenc's tower (with its projector / resampler / merger) has exactly the parameters of
    transformers' modules built from the same config.json dict (full config, so the language width counts)."""
    import transformers

    from mmenc.models.registry import get_builtin_config

    _, hf_config = get_builtin_config(name)
    model_type = hf_config["model_type"]
    config_cls = transformers.AutoConfig.for_model(model_type).__class__
    config = config_cls(vision_config=dict(hf_config["vision_config"]), text_config=dict(hf_config["text_config"]))
    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    names = {"paddleocr_vl": [("PaddleOCRVisionModel", True), ("PaddleOCRProjector", False)],
             "ernie4_5_vl_moe": [("Ernie4_5_VLMoeVisionTransformerPretrainedModel", True),
                                 ("Ernie4_5_VLMoeVariableResolutionResamplerModel", False)],
             "hunyuan_vl": [("HunYuanVLVisionTransformer", True)]}[model_type]
    parts = [(getattr(modeling, cls), config.vision_config if vision else config) for cls, vision in names]
    theirs = _meta_parameters(*parts)
    ours = sum(p.numel() for p in build_tower(name, load_format="dummy", device="meta").tower.parameters())
    print(f"{name}: {ours / 1e6:.1f}M parameters (transformers: {theirs / 1e6:.1f}M)")
    assert ours == theirs, f"{name}: {ours} parameters, transformers' modules have {theirs}"


def test_ernie_video_pairs_frames_and_drops_an_odd_last_one(tmp_path):
    """A 3-frame row: frames (0, 1) merge into one set of tokens, frame 2 is dropped (transformers'
    resampler does the same); a 4-frame row gives two sets. Compared with transformers' tower + resampler."""
    case = ck.FAMILIES["Ernie4_5_VLMoeForConditionalGeneration"]
    try:
        folder, hf_model = case.save(tmp_path)
    except ImportError:
        pytest.skip("this transformers cannot write ERNIE-4.5-VL")
    loaded = build_tower(str(folder), device="cpu")
    for t in (3, 4):
        grid = torch.tensor([[t, 4, 6]])
        pixels = case.pixels(grid, seed=t)
        out = run_tower(loaded, pixels, grid).embeddings
        assert out.shape[0] == loaded.output_tokens(grid)[0] == (t // 2) * 6
        with torch.no_grad():  # transformers' get_video_features cannot split an odd t's rows; call the parts
            hidden = hf_model.model.vision_tower(pixels, grid).last_hidden_state
            want = hf_model.model.resampler_model(hidden, grid)
        err = ck.relative_error(out, want)
        assert err < 1e-5, f"t={t}: relative error {err:.2e} exceeds 1e-5"


def test_hunyuan_output_layout():
    from mmenc.models.hunyuan_vl import output_layout

    # 2 images: 4x4 patches (2x2 merged, 4 rows) and 2x4 patches (1x2 merged, 2 rows); 6 merged rows
    # in all, so newline = 6, begin = 7, end = 8
    got = output_layout(((1, 4, 4), (1, 2, 4)), 2).tolist()
    assert got == [7, 0, 1, 6, 2, 3, 6, 8, 7, 4, 5, 6, 8], got


@pytest.mark.parametrize("arch", OCR_ARCHS)
def test_bench_reference_matches_mmenc(arch, tmp_path):
    """`mmenc bench`'s transformers side (hf_reference / hf_projected) on a checkpoint folder gives mmenc's
    embeddings, so its side-by-side timing compares the same computation."""
    from mmenc.bench.hf_reference import build_hf_tower, hf_tower_available

    case = ck.FAMILIES[arch]
    try:
        folder, _ = case.save(tmp_path)
    except ImportError:
        pytest.skip(f"this transformers cannot write {arch}")
    assert hf_tower_available(arch) is None
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor([[1, 4, 6], [1, 6, 4]])
    pixels = case.pixels(grid, seed=7).reshape(int(grid.prod(-1).sum()), -1)  # as `mmenc bench` passes them
    want = run_tower(loaded, pixels, grid).embeddings
    got = build_hf_tower(loaded)(pixels, grid)
    err = ck.relative_error(want, got)
    assert err < 1e-5, f"{arch}: mmenc vs bench reference relative error {err:.2e} exceeds 1e-5"
