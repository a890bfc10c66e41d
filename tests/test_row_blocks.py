"""Row blocks (mmenc.layers.row_blocks): a forced tiny budget splits VisionBlock's MLP branch and
Ovis2's visual head into row blocks; the outputs equal the unsplit ones (float32, to rounding: the
matmuls see fewer rows) and still match transformers; the split compiles with fullgraph, dynamic in the
token count. Also the block count rule and its errors."""
import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.layers.row_blocks import LOW_INTERMEDIATE_BYTES, MAX_INTERMEDIATE_BYTES, map_rows, num_row_blocks, set_max_intermediate_bytes
from mmenc.layers.vision_blocks import VisionBlock
from mmenc.testing import checkpoints as ck
from mmenc.testing.compare import assert_close

TOL = 1e-5
SPLIT_TOL = 1e-6  # split vs unsplit, float32: only the matmuls' row counts differ


def test_block_count_rule():
    assert num_row_blocks(rows=1000, bytes_per_row=100, budget=None) == 1
    assert num_row_blocks(rows=1000, bytes_per_row=100, budget=100_000) == 1  # exactly the budget: whole
    assert num_row_blocks(rows=1000, bytes_per_row=100, budget=99_999) == 2
    assert num_row_blocks(rows=1000, bytes_per_row=100, budget=30_000) == 4
    assert num_row_blocks(rows=3, bytes_per_row=100, budget=1) == 3  # never more blocks than rows
    with pytest.raises(ValueError, match="max_intermediate_bytes=0"):
        num_row_blocks(rows=10, bytes_per_row=1, budget=0)
    with pytest.raises(ValueError, match="max_intermediate_bytes=-5"):
        set_max_intermediate_bytes(torch.nn.Linear(2, 2), -5)


def test_budgets_split_the_widest_calls_only():
    """The default 1.5 GiB splits only the widest MLPs (InternViT-6B: 57,400 tokens x 12,800 wide, in 2);
    the low 512 MiB budget (modelled for CUDA-graph pools, mmenc.layers.row_blocks) splits InternViT-6B in
    6, Qwen2.5-VL-7B on 8 x 1036 px (43,808 x gate_up 6,840) in 3, HunyuanOCR on 8 pages (43,648 x 4,304)
    in 2, and leaves a call of a few thousand tokens whole (a server's: Qwen2.5-VL at 8,192 tokens)."""
    assert MAX_INTERMEDIATE_BYTES == 3 << 29 and LOW_INTERMEDIATE_BYTES == 512 << 20
    assert num_row_blocks(57_400, 2 * 12_800 * 2, MAX_INTERMEDIATE_BYTES) == 2
    assert num_row_blocks(43_808, 2 * 6_840 * 2, MAX_INTERMEDIATE_BYTES) == 1
    assert num_row_blocks(57_400, 2 * 12_800 * 2, LOW_INTERMEDIATE_BYTES) == 6
    assert num_row_blocks(43_808, 2 * 6_840 * 2, LOW_INTERMEDIATE_BYTES) == 3
    assert num_row_blocks(43_648, 2 * 4_304 * 2, LOW_INTERMEDIATE_BYTES) == 2
    assert num_row_blocks(8_192, 2 * 6_840 * 2, LOW_INTERMEDIATE_BYTES) == 1


def _row_mlp(width_in=24, hidden=160, width_out=40):
    torch.manual_seed(1)
    fc1, fc2 = torch.nn.Linear(width_in, hidden), torch.nn.Linear(hidden, width_out)
    return lambda x: fc2(torch.nn.functional.gelu(fc1(x)))


def test_map_rows_equals_whole():
    """map_rows over row blocks equals the whole computation (float32, to rounding), keeps the output's
    shape and dtype, and leaves the call alone (the very tensor fn returns) under the budget or with None."""
    fn = _row_mlp()
    x = torch.randn(101, 24)
    with torch.inference_mode():
        whole = fn(x)
        per_row = 2 * 160 * 4
        for budget in (per_row * 30, per_row, 1):  # 4 blocks; one row each; one row each (never more than rows)
            blocks = num_row_blocks(101, per_row, budget)
            got = map_rows(fn, x, per_row, budget)
            assert blocks > 1 and got.shape == whole.shape and got.dtype == whole.dtype
            err = assert_close(got, whole, f"map_rows in {blocks} blocks", SPLIT_TOL)
            print(f"map_rows in {blocks} blocks vs whole: relative error {err:.1e}")
        sentinel = torch.zeros(3, 5)
        assert map_rows(lambda _: sentinel, x, per_row, None) is sentinel
        assert map_rows(lambda _: sentinel, x, per_row, per_row * 101) is sentinel
    with pytest.raises(ValueError, match="max_intermediate_bytes=0"):
        map_rows(fn, x, per_row, 0)


def test_pixtral_projector_takes_the_budget():
    """The Pixtral tower's projector (linear_1 -> act -> linear_2) is a budgeted module: set_max_intermediate_bytes
    reaches it, and past the budget it runs over row blocks (see test_tower_split_matches_transformers)."""
    from mmenc.models.pixtral import PixtralVisionConfig, PixtralVisionTower

    tower = PixtralVisionTower(PixtralVisionConfig(depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
                                                   out_hidden_size=48, patch_size=4, image_size=64), device="meta")
    assert tower.max_intermediate_bytes == MAX_INTERMEDIATE_BYTES
    assert set_max_intermediate_bytes(tower, 1000) == 2  # the block and the tower's projector
    assert tower.max_intermediate_bytes == 1000


def _block(mlp: str, **kw) -> VisionBlock:
    torch.manual_seed(0)
    block = VisionBlock(48, 4, 80, norm="rms", mlp=mlp, act="gelu" if mlp == "plain" else "silu", **kw).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block


BLOCKS = {"plain+layer_scale+qk_norm_all": dict(mlp="plain", layer_scale=True, qk_norm="all"),
          "gated": dict(mlp="gated"), "gated+qk_norm_head": dict(mlp="gated", qk_norm="head")}


@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("dense", [False, True], ids=["packed", "dense"])
def test_block_split_equals_whole(kind, dense):
    block = _block(**BLOCKS[kind])
    x = torch.randn(3, 37, 48) if dense else torch.randn(111, 48)
    cu = torch.tensor([0, 37, 74, 111], dtype=torch.int32)
    with torch.inference_mode():
        whole = block(x, cu, 37)
        for budget in (10_000, 1):  # a few blocks; one row per block
            block.max_intermediate_bytes = budget
            split = block(x, cu, 37)
            blocks = num_row_blocks(111, 2 * block.mlp.intermediate_width * 4, budget)
            assert blocks > 1
            err = assert_close(split, whole, f"{kind} {'dense' if dense else 'packed'} in {blocks} row blocks", SPLIT_TOL)
            print(f"{kind}: {blocks} row blocks vs whole: relative error {err:.1e}, bitwise {torch.equal(split, whole)}")
    assert split.shape == x.shape


def test_block_split_compiles_fullgraph_dynamic():
    """Compiled (inductor, fullgraph, dynamic token count) with a split: equal to eager at two token counts
    with the same block count, without a recompile between them."""
    from mmenc.config import MultiModalConfig
    from mmenc.engine.compile import compiled_forward

    block = _block(**BLOCKS["plain+layer_scale+qk_norm_all"])
    block.max_intermediate_bytes = 20_000  # 100-odd rows x 640 bytes: 4 blocks
    compiled = compiled_forward(VisionBlock, MultiModalConfig(compile=True))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.inference_mode():
        for tokens in (111, 117):
            x = torch.randn(tokens, 48)
            cu = torch.tensor([0, 37, tokens], dtype=torch.int32)
            want = block(x, cu, tokens - 37)
            got = compiled(block, x, cu, tokens - 37)
            assert num_row_blocks(tokens, 2 * 80 * 4, 20_000) == 4
            err = assert_close(got, want, f"compiled split block, {tokens} tokens", 1e-5)
            print(f"compiled split block, {tokens} tokens: relative error {err:.1e} vs eager")
    frames = counters["stats"]["unique_graphs"]
    assert frames == 1, f"{frames} graphs compiled for two token counts with the same block count; expected 1"


@pytest.mark.parametrize("arch", ["Ovis2ForConditionalGeneration", "InternVLForConditionalGeneration",
                                  "Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration",
                                  "Mistral3ForConditionalGeneration"])
def test_tower_split_matches_transformers(arch, tmp_path):
    """A tiny checkpoint with every row-block budget in the tower forced tiny (Ovis2: its head too; Pixtral,
Llava and Mistral3: its projector too):
    equal to the unsplit tower and to transformers."""
    case = ck.FAMILIES[arch]
    try:
        folder, hf_model = case.save(tmp_path)
    except ImportError:
        pytest.skip(f"this transformers cannot write {arch}")
    loaded = build_tower(str(folder), device="cpu")
    grid = torch.tensor(case.grid) if case.grid is not None else torch.tensor([[1, 2, 2], [1, 6, 10], [1, 10, 4]])
    pixels = case.pixels(grid, seed=3)
    whole = run_tower(loaded, pixels, grid).embeddings
    found = set_max_intermediate_bytes(loaded.tower, 64)
    assert found >= 1, f"{arch}: no module with max_intermediate_bytes"
    split = run_tower(loaded, pixels, grid).embeddings
    err = assert_close(split, whole, f"{arch} split vs whole", SPLIT_TOL)
    want, _ = case.reference(hf_model, pixels, grid)
    err_hf = assert_close(split, want, f"{arch} split vs transformers", TOL)
    print(f"{arch}: {found} modules split; vs whole {err:.1e}, vs transformers {err_hf:.1e} (tolerance {TOL:.0e})")


@pytest.mark.parametrize("arch", ["InternVLForConditionalGeneration", "Ovis2ForConditionalGeneration",
                                  "Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration"])
def test_split_keeps_batch_invariance(arch, tmp_path):
    """batch_invariant=True with a budget that splits differently per call size: the watched image's
    embedding is still bitwise the same alone and in mixed calls."""
    from test_batch_invariance import CALLS, TARGET, _assert_equal, _family_grids, _per_image, _pixels

    from mmenc.engine.encoder import Encoder

    case = ck.FAMILIES[arch]
    try:
        folder, _ = case.save(tmp_path)
    except ImportError:
        pytest.skip(f"this transformers cannot write {arch}")
    enc = Encoder(str(folder), device="cpu", batch_invariant=True)
    assert set_max_intermediate_bytes(enc.tower, 3000) >= 1
    shape = _family_grids(case)
    pixels, grid = _pixels(case, [shape[TARGET]])
    alone = _per_image(enc, enc.encode_pixels(pixels, grid, return_extras=True), grid, 0)
    for grids, index, _ in CALLS[:4]:
        pixels, grid = _pixels(case, [shape[g] for g in grids])
        out = enc.encode_pixels(pixels, grid, return_extras=True)
        _assert_equal(alone, _per_image(enc, out, grid, index), f"{arch} in row blocks, call {grids}")
