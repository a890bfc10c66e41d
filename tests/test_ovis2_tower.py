"""Ovis2: what the generic tower tests do not cover (their FAMILIES row checks parity, TP and data
mode): the cropping processor against transformers' Ovis2ImageProcessorPil (and its torchvision
class where torchvision is importable), the layout rules, the crop-size check and the config reader."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.models.ovis2 import Ovis2VisionConfig, Ovis2VisionTower
from mmenc.models.registry import get_builtin_config
from mmenc.preprocess.ovis2 import Ovis2Processor, Ovis2ProcessorConfig, covering_layout, ovis2_from_hf

HAS_TV = importlib.util.find_spec("torchvision") is not None
SIZES = [(200, 300), (800, 600), (448, 448), (37, 1500), (1000, 90), (5, 5), (673, 1345)]
CONFIGS = [{"size": {"height": 112, "width": 112}, "crop_to_patches": False},
           {"size": {"height": 112, "width": 112}, "crop_to_patches": True, "max_patches": 6},
           {"size": {"height": 112, "width": 112}, "crop_to_patches": True, "max_patches": 9,
            "use_covering_area_grid": False, "min_patches": 2}]
BACKENDS = ["pil"] + (["torchvision"] if HAS_TV else [])


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=["resize", "covering", "aspect"])
def test_matches_transformers(cfg, backend):
    import transformers

    cls = "Ovis2ImageProcessorPil" if backend == "pil" else "Ovis2ImageProcessor"
    hf = getattr(transformers, cls)(**cfg)
    ims = _images()
    want = hf(ims, return_tensors="pt")
    ours = ovis2_from_hf(cfg, backend=backend)
    pixels, grid = ours(ims)
    crops = [r * c + (r * c > 1) for r, c in want["grids"].tolist()]
    assert grid[:, 0].tolist() == crops, f"crops per image {grid[:, 0].tolist()}, transformers {crops}"
    t, p = ours.config.crop_size, ours.config.patch_size
    s = t // p
    ref = want["pixel_values"].float().view(-1, 3, s, p, s, p).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, p, p)
    assert pixels.shape == ref.shape, f"pixel_values {tuple(pixels.shape)}, transformers {tuple(ref.shape)}"
    diff = (pixels - ref).abs().max().item()
    level = 1 / 255 / min(ours.config.image_std)
    print(f"ovis2 processor {backend} {cfg}: max abs diff {diff:.3g} (one uint8 level = {level:.4f})")
    assert diff <= level + 1e-6, f"max abs diff {diff} exceeds one uint8 level ({level:.4f})"


def test_layout_rules():
    assert covering_layout(448, 448, 448, 12) == (1, 1)
    cols, rows = covering_layout(448, 1344, 448, 12)  # a wide image gets several crops
    assert cols * rows > 1
    proc = Ovis2Processor(Ovis2ProcessorConfig(crop_size=56))
    plan = proc.plan(56, 56)
    assert plan.grid == (1, 4, 4) and plan.rows == 16
    wide = proc.plan(56, 300)
    assert wide.grid[0] == wide.resize[0] // 56 * (wide.resize[1] // 56) + 1  # crops + the thumbnail


def test_processor_config_errors():
    with pytest.raises(ValueError, match=r"size=\{'height': 448, 'width': 224\}"):
        Ovis2ProcessorConfig.from_hf({"size": {"height": 448, "width": 224}})
    with pytest.raises(ValueError, match="crop_size=100 must be a multiple of patch_size=14"):
        Ovis2ProcessorConfig(crop_size=100)


def test_grid_must_be_whole_crops():
    cfg = Ovis2VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=40, image_size=56,
                            spatial_merge_size=2, vocab_size=16, out_hidden_size=8)
    tower = Ovis2VisionTower(cfg)
    with pytest.raises(ValueError, match=r"grid_thw\[0\] = \(1, 6, 4\).*4 x 4 patches"):
        tower.plan(torch.tensor([[1, 6, 4]]), "cpu")


def test_published_config_reads():
    _, hf = get_builtin_config("thisisiron/Ovis2-2B-hf")
    cfg = Ovis2VisionConfig.from_hf(hf)
    assert (cfg.depth, cfg.hidden_size, cfg.head_dim, cfg.tile_side, cfg.spatial_merge_size, cfg.out_hidden_size) == \
        (24, 1024, 128, 32, 2, 1536)
    with pytest.raises(ValueError, match="tokenize_function='gumbel_argmax'"):
        Ovis2VisionConfig.from_hf({"vision_config": {"tokenize_function": "gumbel_argmax"}})
