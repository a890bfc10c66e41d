"""The benchmark's building blocks: grid specs, and the FLOP count behind "floor %" checked against
torch's own FlopCounterMode (matmuls and SDPA) on a tiny tower."""
import re

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from mmenc.bench.flops import count_flops
from mmenc.bench.measure import parse_grid_spec
from mmenc.config import MultiModalConfig
from mmenc.engine.tower import build_tower, run_tower
from mmenc.testing.checkpoints import random_pixels, save_qwen2_5_vl


def test_parse_grid_spec():
    assert parse_grid_spec("1x74x74*8") == [(1, 74, 74)] * 8
    assert parse_grid_spec("2x4x6") == [(2, 4, 6)]
    for bad in ["1x74", "1x0x4", "axbxc", "1x4x4*0", "1x4x4*x"]:
        with pytest.raises(ValueError, match=re.escape(f"grid spec '{bad}'")):
            parse_grid_spec(bad)


def test_flop_count_matches_torch_flop_counter(tmp_path):
    folder, _ = save_qwen2_5_vl(tmp_path / "q")  # window and full layers, uneven windows
    # NATIVE linears: FlopCounterMode counts aten's matmuls, not oneDNN's op inside mmenc::onednn_linear
    loaded = build_tower(str(folder), device="cpu",
                         multimodal_config=MultiModalConfig(mm_encoder_attn_backend="TORCH_SDPA",
                                                            linear_backend="native"))
    grid = torch.tensor([[1, 8, 12], [2, 4, 4]])
    pixels = random_pixels(grid)
    with count_flops(loaded.tower) as counter:
        run_tower(loaded, pixels, grid)
    with FlopCounterMode(display=False) as torch_counter:
        run_tower(loaded, pixels, grid)
    # FlopCounterMode sees the attention custom op as opaque, so it counts the matmuls only; the
    # attention term is 4 * sum(len^2) * heads * head_dim per layer (2 heads of 16 here):
    # full layers (1, 3): one segment per frame, 96 + 16 + 16 patches -> sum(len^2) = 9728;
    # window layers (0, 2): 2x2 merged-token windows of 16 patches: 6 + 1 + 1 -> sum(len^2) = 2048.
    attention = 2 * 4 * 9728 * 2 * 16 + 2 * 4 * 2048 * 2 * 16
    matmuls = torch_counter.get_total_flops()
    assert matmuls > 0 and counter["flops"] == matmuls + attention, (
        f"mmenc counted {counter['flops']} FLOPs; expected {matmuls} (matmuls, torch's FlopCounterMode) + "
        f"{attention} (attention)")
