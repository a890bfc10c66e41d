"""Qwen2.5-VL's windowed attention (fp32, CPU): window order, uneven edge windows, window and
full-attention layers both running, against transformers' own tower on grids chosen for the
windows. Parity on a mixed batch, errors, built-ins and parallel modes for Qwen2-VL and Qwen2.5-VL
are in test_towers_generic.py."""
import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.layers.grid import frame_lengths
from mmenc.models.qwen2_5_vl import Qwen2_5_VisionConfig, window_order
from mmenc.models.registry import get_builtin_config
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

pytest.importorskip("transformers")

TOL = 1e-5
ARCH = "Qwen2_5_VLForConditionalGeneration"

# (t, h, w) in patches. Merged grid = h/2 x w/2; the tiny window is 2x2 merged tokens, so odd
# merged sides give uneven edge windows.
GRIDS = {
    "square": [[1, 8, 8]],  # windows fit exactly
    "wide_then_video": [[1, 2, 14], [2, 4, 4], [1, 6, 2]],  # one-window-high strip, video, one-window-wide
    "mixed": [[1, 2, 2], [1, 6, 10], [2, 8, 6], [1, 10, 4]],
}


@pytest.fixture(scope="module")
def qwen2_5(tmp_path_factory):
    folder, model = ck.FAMILIES[ARCH].save(tmp_path_factory.mktemp("qwen2_5_vl"))
    return build_tower(str(folder), device="cpu"), model


@pytest.mark.parametrize("case", ["square", "wide_then_video"])
def test_windows_match_transformers(qwen2_5, case):
    loaded, hf_model = qwen2_5
    family = ck.FAMILIES[ARCH]
    grid = torch.tensor(GRIDS[case])
    pixels = family.pixels(grid)
    want, _ = family.reference(hf_model, pixels, grid)
    err = assert_close(run_tower(loaded, pixels, grid).embeddings, want, f"{ARCH} grid={GRIDS[case]}", TOL)
    print(f"{ARCH} grid={GRIDS[case]}: relative error {err:.2e} (tolerance {TOL:.0e})")


def test_window_and_full_layers_run_with_uneven_windows(qwen2_5):
    loaded, _ = qwen2_5
    tower, config = loaded.tower, loaded.config
    assert 0 < len(tower.full_attention) < config.depth  # both kinds of layer run
    plan = tower.plan(torch.tensor(GRIDS["mixed"]), "cpu")
    windows = torch.diff(plan.cu_window_seqlens).tolist()
    frames = torch.diff(plan.cu_seqlens).tolist()
    assert frames == frame_lengths(tuple(map(tuple, GRIDS["mixed"])))
    assert len(set(windows)) > 1 and len(windows) > len(frames)  # uneven windows, more than frames
    assert sum(windows) == sum(frames)
    assert plan.cu_seqlens.dtype == torch.int32 and plan.cu_window_seqlens.dtype == torch.int32


def test_window_order_covers_every_token_once():
    order, lengths = window_order(2, 10, 6, merge=2, window=2)  # merged 5x3 per frame
    assert sorted(order.tolist()) == list(range(2 * 5 * 3))
    assert lengths == [4, 2, 4, 2, 2, 1] * 2


def test_window_config_from_hf_and_validation(qwen2_5):
    cfg = Qwen2_5_VisionConfig.from_hf(get_builtin_config("Qwen/Qwen2.5-VL-7B-Instruct")[1])
    assert cfg.fullatt_block_indexes == (7, 15, 23, 31) and cfg.merged_window == 4
    saved = qwen2_5[0].config  # read back from the tiny checkpoint's config.json
    assert saved.fullatt_block_indexes == (1, 3) and saved.window_size == 56 and saved.merged_window == 2
    with pytest.raises(ValueError, match="window_size=100"):
        Qwen2_5_VisionConfig(hidden_size=32, num_heads=2, window_size=100)
    with pytest.raises(ValueError, match=r"fullatt_block_indexes has \[9\]"):
        Qwen2_5_VisionConfig(depth=4, hidden_size=32, num_heads=2, fullatt_block_indexes=(1, 9))
