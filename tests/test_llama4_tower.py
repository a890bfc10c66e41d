"""Llama 4: what the generic tower tests do not cover (their FAMILIES row checks parity, TP and data
mode): the tiling processor against transformers' Llama4ImageProcessor (torchvision only: skipped
without it), the canvas rules, the tile-size check and the config reader."""
import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image

from mmenc.models.llama4 import Llama4VisionConfig, Llama4VisionTower
from mmenc.models.registry import get_builtin_config
from mmenc.preprocess.llama4 import Llama4Processor, Llama4ProcessorConfig, best_canvas, llama4_from_hf, tile_canvases

needs_tv = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None,
                              reason="transformers' Llama4ImageProcessor needs torchvision")
SIZES = [(200, 300), (800, 600), (336, 336), (37, 1500), (1000, 90), (5, 5), (673, 1345), (2000, 2000)]


def _images():
    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]


@needs_tv
@pytest.mark.parametrize("cfg", [{}, {"max_patches": 6, "size": {"height": 112, "width": 112}},
                                 {"resize_to_max_canvas": True, "max_patches": 4}], ids=["default", "small", "max"])
def test_matches_transformers(cfg):
    from transformers.models.llama4.image_processing_llama4 import Llama4ImageProcessor

    ims = _images()
    want = Llama4ImageProcessor(**cfg)(ims, return_tensors="pt")
    ours = llama4_from_hf(cfg)
    pixels, grid = ours(ims)
    tiles = [int(r) * int(c) + (int(r) * int(c) > 1) for r, c in want["aspect_ratios"]]
    assert grid[:, 0].tolist() == tiles, f"tiles per image {grid[:, 0].tolist()}, transformers {tiles}"
    t, p = ours.config.tile_size, ours.config.patch_size
    s = t // p
    ref = want["pixel_values"].float()  # [tiles, C, T, T] -> our rows [tiles * s * s, C, p, p]
    ref = ref.view(-1, 3, s, p, s, p).permute(0, 2, 4, 1, 3, 5).reshape(-1, 3, p, p)
    assert pixels.shape == ref.shape, f"pixel_values {tuple(pixels.shape)}, transformers {tuple(ref.shape)}"
    diff = (pixels - ref).abs().max().item()
    level = 1 / 255 / 0.5
    print(f"llama4 processor {cfg}: max abs diff {diff:.3g} (one uint8 level = {level:.4f})")
    assert diff <= level + 1e-6, f"max abs diff {diff} exceeds one uint8 level ({level:.4f})"


def test_canvas_rules():
    assert tile_canvases(4)[:4] == ((1, 4), (2, 2), (1, 1), (4, 1))  # grouped by aspect ratio, as transformers
    assert set(tile_canvases(4)) == {(1, 4), (2, 2), (4, 1), (1, 3), (3, 1), (1, 2), (2, 1), (1, 1)}
    assert best_canvas(200, 300, 336, 16, False) == (336, 336)  # smallest upscale
    assert best_canvas(800, 600, 336, 16, False) == (1008, 672)  # 3 x 2 tiles
    assert best_canvas(100, 100, 336, 16, True) == (1344, 1344)  # largest upscale: 4 x 4


def test_plan_matches_output_and_grid():
    proc = Llama4Processor(Llama4ProcessorConfig(tile_size=56, max_patches=4))
    ims = [Image.new("RGB", (w, h), (10, 200, 30)) for h, w in ((50, 50), (60, 130), (300, 40))]
    pixels, grid = proc(ims)
    plans = [proc.plan(im.height, im.width) for im in ims]
    assert grid.tolist() == [list(pl.grid) for pl in plans]
    assert pixels.shape == (sum(pl.rows for pl in plans), 3, 14, 14)
    assert grid[0].tolist() == [1, 4, 4] and grid[1, 0] == 4  # one tile; 1 x 3 tiles + the global one


def test_processor_config_errors():
    with pytest.raises(ValueError, match=r"size=\{'height': 336, 'width': 224\}"):
        Llama4ProcessorConfig.from_hf({"size": {"height": 336, "width": 224}})
    with pytest.raises(ValueError, match="tile_size=100 must be a multiple of patch_size=14"):
        Llama4ProcessorConfig(tile_size=100)


def test_grid_must_be_whole_tiles():
    cfg = Llama4VisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=128, image_size=56,
                             projector_input_dim=8, projector_output_dim=8, vision_output_dim=8, out_hidden_size=8)
    tower = Llama4VisionTower(cfg)
    with pytest.raises(ValueError, match=r"grid_thw\[1\] = \(1, 4, 6\).*4 x 4 patches"):
        tower.plan(torch.tensor([[2, 4, 4], [1, 4, 6]]), "cpu")


def test_published_config_reads():
    _, hf = get_builtin_config("meta-llama/Llama-4-Scout-17B-16E-Instruct")
    cfg = Llama4VisionConfig.from_hf(hf)
    assert (cfg.depth, cfg.hidden_size, cfg.head_dim, cfg.tile_side, cfg.spatial_merge_size, cfg.out_hidden_size) == \
        (34, 1408, 88, 24, 2, 5120)
    with pytest.raises(ValueError, match="pixel_shuffle_ratio=0.3"):
        Llama4VisionConfig.from_hf({"vision_config": {"pixel_shuffle_ratio": 0.3}})
    with pytest.raises(ValueError, match="intermediate_size=100"):
        Llama4VisionConfig(intermediate_size=100)


def test_dense_blocks_compile_without_graph_breaks(tmp_path):
    """The dense [tiles, S] path through the shared blocks traces in one graph (Dynamo, backend eager)
    and gives the same output; Ovis2 runs the same dense path."""
    import torch._dynamo

    from mmenc.config import MultiModalConfig
    from mmenc.engine.compile import compile_tower
    from mmenc.engine.tower import build_tower, run_tower
    from mmenc.testing import checkpoints as ck

    pytest.importorskip("transformers")
    folder, _ = ck.save_llama4(tmp_path / "llama4")
    loaded = build_tower(str(folder), device="cpu")
    grids = [torch.tensor([[2, 4, 4], [1, 4, 4]]), torch.tensor([[4, 4, 4]])]
    pixels = [ck.random_pixels(g, 588, seed=i) for i, g in enumerate(grids)]
    want = [run_tower(loaded, p, g).embeddings for p, g in zip(pixels, grids)]
    torch._dynamo.reset()
    n = compile_tower(loaded.tower, MultiModalConfig(compile=True), backend="eager", fullgraph=True)
    assert n == loaded.config.depth, f"compiled {n} of {loaded.config.depth} blocks"
    for p, g, w in zip(pixels, grids, want):
        got = run_tower(loaded, p, g).embeddings
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-6), "compiled output differs"


def test_dense_attention_forms_agree():
    """VisionAttention on dense rows [B, S, dim]: MMEncoderAttention's dense form (cu_seqlens None), the
    rows as equal segments (what fixed-size towers pass) and each row alone give the same output."""
    from mmenc.attention import make_cu_seqlens
    from mmenc.layers.vision_blocks import VisionAttention

    torch.manual_seed(0)
    attn = VisionAttention(32, 2, rotary_interleaved=True)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, 0.2)
    x = torch.randn(3, 7, 32)
    cos, sin = torch.randn(7, 16).cos(), torch.randn(7, 16).sin()
    cu, max_len = make_cu_seqlens([7] * 3, "cpu")
    with torch.no_grad():
        dense = attn(x, None, None, (cos, sin))
        segments = attn(x, cu, max_len, (cos, sin))
        rows = torch.cat([attn(x[i:i + 1], None, None, (cos, sin)) for i in range(3)])
    assert dense.shape == (3, 7, 32)
    assert torch.allclose(dense, segments, atol=1e-6) and torch.allclose(dense, rows, atol=1e-6)
