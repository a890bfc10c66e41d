"""Batch invariance (MultiModalConfig(batch_invariant=True)) and per-segment attention choice.

CPU fp32: for every registered architecture (mmenc.testing.checkpoints.FAMILIES), an image's
embedding (and extra outputs) is torch.equal whether it is encoded alone, with small or large
images before or after it, in another order, split over several tower calls (max_batch_patches),
or on another data-mode rank. Default mode: a pack's short segments go to the short backend even
beside a long segment, and splitting the pack by length class equals running each class apart.
GPU (bf16, marked gpu): the same invariance on CUDA eager, compiled and with CUDA graphs, and the
tile GEMM's row-position independence on the tower's real shapes.
CPU, images in through each model's preprocessing: the same invariance with hundreds of tokens per
image, and the CPU's position-independent activations (mmenc.layers.activation.InvariantActivation).
"""
import numpy as np
import pytest
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import BackendChoice, DeviceInfo, make_cu_seqlens
from mmenc.backends.dispatch import attend
from mmenc.backends.naive import NaiveBackend
from mmenc.backends.packing import chunk_segments, pack_info, sub_packs
from mmenc.backends.registry import get_backend_class
from mmenc.backends.sdpa import TorchSDPABackend
from mmenc.config import MultiModalConfig
from mmenc.engine.encoder import Encoder
from mmenc.layers.activation import InvariantActivation, QuickGELU, use_invariant_activations
from mmenc.layers.token_tiles import tiled_linear
from mmenc.platforms.cuda import CudaPlatform
from mmenc.platforms.interface import Platform
from mmenc.testing import checkpoints as ck

TARGET = (1, 4, 6)  # the image watched; the others share its calls
SMALL, LARGE, VIDEO = (1, 2, 2), (1, 10, 8), (2, 4, 4)
# (grids of the call, index of TARGET in it, max_batch_patches or None)
CALLS = [
    ([SMALL, TARGET], 1, None),
    ([TARGET, LARGE], 0, None),
    ([LARGE, SMALL, TARGET, VIDEO], 2, None),
    ([VIDEO, TARGET, SMALL, LARGE, SMALL], 1, None),
    ([SMALL, LARGE, TARGET, VIDEO, SMALL], 2, 40),  # several tower calls: TARGET shares one with VIDEO
]


def _pixels(case: ck.FamilyCase, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """pixel_values for `grids`, each image's rows fixed by its grid (TARGET's are the same in every call)."""
    rows = [case.pixels(torch.tensor([g]), seed=sum(g) * 7 + g[1]) for g in grids]
    return torch.cat(rows), torch.tensor(grids)


def _per_image(enc: Encoder, out, grid: torch.Tensor, index: int) -> list[torch.Tensor]:
    """The index-th image's embeddings and its share of every tensor extra output."""
    tokens = enc.output_tokens(grid)
    start, n = sum(tokens[:index]), tokens[index]
    got = [out.embeddings[start:start + n]]
    for value in out.extras.values():
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor) and t.shape[0] == sum(tokens):
                got.append(t[start:start + n])
    return got


def _assert_equal(alone: list[torch.Tensor], mixed: list[torch.Tensor], what: str) -> None:
    assert len(alone) == len(mixed)
    for i, (a, b) in enumerate(zip(alone, mixed)):
        diff = float((a.float() - b.float()).abs().max())
        assert torch.equal(a, b), f"{what}: output {i} differs from the image encoded alone by up to {diff:.3e}"


@pytest.fixture(scope="module", params=sorted(ck.FAMILIES))
def family_folder(request, tmp_path_factory):
    pytest.importorskip("transformers")
    case = ck.FAMILIES[request.param]
    try:
        folder, _ = case.save(tmp_path_factory.mktemp(request.param))
    except ImportError:
        pytest.skip(f"this transformers cannot write {request.param}")
    return request.param, case, str(folder)


def _family_grids(case: ck.FamilyCase) -> dict:
    """TARGET, SMALL, LARGE, VIDEO as this family takes them: fixed-size towers (case.grid set: rows of
    (tiles, s, s)) get 2, 1, 3 and 1 tiles of their own size."""
    if case.grid is None:
        return {g: g for g in (TARGET, SMALL, LARGE, VIDEO)}
    side = case.grid[0][1]
    return {TARGET: (2, side, side), SMALL: (1, side, side), LARGE: (3, side, side), VIDEO: (1, side, side)}


def test_every_family_is_batch_invariant(family_folder):
    arch, case, folder = family_folder
    enc = Encoder(folder, device="cpu", batch_invariant=True)
    shape = _family_grids(case)
    pixels, grid = _pixels(case, [shape[TARGET]])
    alone = _per_image(enc, enc.encode_pixels(pixels, grid, return_extras=True), grid, 0)
    for grids, index, max_patches in CALLS:
        enc.max_batch_patches = max_patches or (1 << 16)
        pixels, grid = _pixels(case, [shape[g] for g in grids])
        out = enc.encode_pixels(pixels, grid, return_extras=True)
        _assert_equal(alone, _per_image(enc, out, grid, index),
                      f"{arch}, call {grids} (max_batch_patches={max_patches})")


def test_data_mode_ranks_match_one_process(tmp_path):
    pytest.importorskip("transformers")
    case = ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"]
    folder = str(case.save(tmp_path)[0])
    one = Encoder(folder, device="cpu", batch_invariant=True)
    pixels, grid = _pixels(case, [TARGET])
    alone = one.encode_pixels(pixels, grid)
    grids = [LARGE, SMALL, TARGET, VIDEO, SMALL, TARGET]  # TARGET twice: on different ranks
    pixels, grid = _pixels(case, grids)
    with Encoder(folder, device="cpu", tensor_parallel_size=2, mm_encoder_tp_mode="data", batch_invariant=True,
                 worker_timeout_s=120) as enc:
        out = enc.encode_pixels(pixels, grid, return_extras=True)
    for index in (2, 5):
        _assert_equal([alone], _per_image(one, out, grid, index)[:1], f"data mode, image {index}")


def test_config_flag_validated_and_hashed():
    assert MultiModalConfig().batch_invariant is False
    assert MultiModalConfig(batch_invariant=True).compute_hash() != MultiModalConfig().compute_hash()
    with pytest.raises(ValueError, match=r"batch_invariant='yes' must be True or False"):
        MultiModalConfig(batch_invariant="yes")


def test_cli_flag_reaches_the_encoder():
    import argparse

    from mmenc.cli.common import add_encoder_args, encoder_kwargs

    parser = argparse.ArgumentParser()
    add_encoder_args(parser, "test")
    assert encoder_kwargs(parser.parse_args(["--batch-invariant"]), "m")["batch_invariant"] is True
    assert encoder_kwargs(parser.parse_args([]), "m")["batch_invariant"] is False


def test_linears_and_attention_switch_with_the_config(tmp_path):
    pytest.importorskip("transformers")
    folder = str(ck.save_qwen2_5_vl(tmp_path)[0])
    enc = Encoder(folder, device="cpu", batch_invariant=True)
    assert enc.attention_backends().endswith(", batch-invariant")
    empty = enc.encode_pixels(torch.empty(0, ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"].patch_features),
                              torch.empty(0, 3, dtype=torch.int64))  # the meta-device tower runs the tiled op too
    assert empty.shape == (0, enc.loaded.config.out_hidden_size)
    tower = enc.tower
    linears = [m for m in tower.modules() if hasattr(m, "token_tile")]
    assert linears and all(m.token_tile is not None for m in linears)  # blocks, patch embedding, merger
    assert {type(m).__name__ for m in tower.modules() if getattr(m, "token_tile", None)} >= {"ReplicatedLinear"}
    attn = [m for m in tower.modules() if type(m).__name__ == "MMEncoderAttention"]
    assert attn and all(m.choice.batch_invariant for m in attn)
    plain = Encoder(folder, device="cpu").tower
    assert all(getattr(m, "token_tile", None) is None for m in plain.modules())


def test_tiled_linear_pads_to_one_shape_and_matches_linear():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 11, 8), torch.randn(5, 8), torch.randn(5)
    shapes = []
    original = torch.addmm

    def spy(bias, a, m, out):
        shapes.append(tuple(a.shape))
        return original(bias, a, m, out=out)

    y = tiled_linear(x, w, b, 4)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
    torch.addmm = spy
    try:
        tiled_linear(x, w, b, 4)
    finally:
        torch.addmm = original
    assert shapes == [(4, 8)] * 6  # 22 rows: five full tiles and one padded one
    with pytest.raises(ValueError, match="tile=-1 must be a positive"):
        tiled_linear(x, w, b, -1)


def test_tiled_linear_pads_unaligned_rows_in_both_operands(monkeypatch):
    """Rows of 3420 bf16 values (6840 bytes) are zero-padded to 3424 in x and W; the result is the
    same sums, and a row's bits do not depend on the other rows."""
    torch.manual_seed(1)
    x, w, b = torch.randn(70, 3420).bfloat16(), (torch.randn(24, 3420) * 0.02).bfloat16(), torch.randn(24).bfloat16()
    shapes = []
    original = torch.addmm

    def spy(bias, a, m, out):
        shapes.append((tuple(a.shape), tuple(m.shape)))
        return original(bias, a, m, out=out)

    monkeypatch.setattr(torch, "addmm", spy)
    got = tiled_linear(x, w, b, 32)
    assert shapes == [((32, 3424), (3424, 24))] * 3
    torch.testing.assert_close(got.float(), torch.nn.functional.linear(x.float(), w.float(), b.float()),
                               rtol=2e-2, atol=2e-2)
    assert torch.equal(tiled_linear(x[5:9], w, b, 32), got[5:9])
    strided = torch.zeros(70, 3424).bfloat16()[:, :3420]  # e.g. Inductor's padded strides
    strided.copy_(x)
    assert torch.equal(tiled_linear(strided, w, b, 32), got)


def test_narrow_linears_get_the_narrow_tile():
    from mmenc.layers.linear import ReplicatedLinear
    from mmenc.layers.linear_kernels import use_token_tiles
    from mmenc.layers.token_tiles import NARROW_OUT_FEATURES, NARROW_TOKEN_TILE, TOKEN_TILE, TRITON_GEMM

    wide = ReplicatedLinear(16, NARROW_OUT_FEATURES, device="meta")
    narrow = ReplicatedLinear(16, NARROW_OUT_FEATURES - 1, device="meta")
    model = torch.nn.Sequential(wide, narrow)
    assert use_token_tiles(model) == 2
    assert (wide.token_tile, narrow.token_tile) == (TOKEN_TILE, NARROW_TOKEN_TILE)
    use_token_tiles(model, 4096, narrow_tile=None)
    assert (wide.token_tile, narrow.token_tile) == (4096, 4096)
    use_token_tiles(model, TRITON_GEMM)
    assert (wide.token_tile, narrow.token_tile) == (TRITON_GEMM, TRITON_GEMM)
    use_token_tiles(model, None)
    assert (wide.token_tile, narrow.token_tile) == (None, None)
    with pytest.raises(ValueError, match="narrow_tile=-2 must be a positive number"):
        use_token_tiles(model, narrow_tile=-2)
    on_cpu = ReplicatedLinear(16, 8, device="cpu")
    use_token_tiles(on_cpu)
    assert on_cpu.token_tile == TOKEN_TILE  # narrow tiles are for GPUs only


# -- attention: per-class choice (default mode) and fixed sub-packs (invariant mode) --------------

class _FakePlatform(Platform):
    """CPU platform with a short backend: NAIVE for segments <= 8 tokens, TORCH_SDPA for longer."""

    name = "fake"
    custom_op_key = "cpu"
    short_seqlen_max = 8

    def vit_attn_priority(self, dtype):
        return [B.TORCH_SDPA, B.NAIVE]

    def vit_attn_short_priority(self, dtype):
        return [B.NAIVE]


def _qkv(total: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(total, 2, 16, generator=g) for _ in range(3)]


def _spy(monkeypatch) -> dict[str, list]:
    seen: dict[str, list] = {"NAIVE": [], "TORCH_SDPA": []}
    for cls in (NaiveBackend, TorchSDPABackend):
        original = cls.forward.__func__

        def forward(klass, q, k, v, cu_seqlens, max_seqlen, scale, original=original):
            seen[klass.enum.name].append(pack_info(cu_seqlens, q.shape[0]).lengths)
            return original(klass, q, k, v, cu_seqlens, max_seqlen, scale)
        monkeypatch.setattr(cls, "forward", classmethod(forward))
    return seen


def test_short_segments_use_the_short_backend_beside_a_long_one(monkeypatch):
    from mmenc.attention import MMEncoderAttention
    from mmenc.platforms import set_current_platform

    set_current_platform(_FakePlatform(DeviceInfo(type="cpu", vendor="cpu")))
    try:
        layer = MMEncoderAttention(num_heads=2, head_size=16, scale=0.25)
    finally:
        set_current_platform(None)
    assert layer.choice == BackendChoice(B.TORCH_SDPA, B.NAIVE, 8)
    lengths = [5, 20, 3, 8, 30, 0, 2]
    q, k, v = _qkv(sum(lengths))
    cu, max_seqlen = make_cu_seqlens(lengths)
    seen = _spy(monkeypatch)
    out = layer(q[None], k[None], v[None], cu, max_seqlen)[0]  # [1, T, H, D] through the layer
    assert seen == {"NAIVE": [(5, 3, 8, 2)], "TORCH_SDPA": [(20, 30)]}
    # the same as running each class as a pack of its own
    starts = pack_info(cu, q.shape[0]).starts()
    for cls, segs in ((NaiveBackend, [0, 2, 3, 6]), (TorchSDPABackend, [1, 4])):
        rows = torch.tensor([starts[s] + j for s in segs for j in range(lengths[s])])
        sub_cu, sub_max = make_cu_seqlens([lengths[s] for s in segs])
        want = cls.forward(q[rows], k[rows], v[rows], sub_cu, sub_max, 0.25)
        assert torch.equal(out[rows], want), f"{cls.enum.name} class differs from running it apart"
    # and each class's rows equal the reference's
    torch.testing.assert_close(out, NaiveBackend.forward(q, k, v, cu, max_seqlen, 0.25), rtol=1e-5, atol=1e-5)


def test_one_class_packs_run_whole_at_no_extra_cost(monkeypatch):
    choice = BackendChoice(B.TORCH_SDPA, B.NAIVE, 8)
    for lengths, backend in (([5, 3, 8], "NAIVE"), ([20, 9], "TORCH_SDPA")):
        cu, max_seqlen = make_cu_seqlens(lengths)
        assert sub_packs(pack_info(cu, sum(lengths)), 8, False, torch.device("cpu")) is None
        seen = _spy(monkeypatch)
        q, k, v = _qkv(sum(lengths))
        attend(q, k, v, cu, max_seqlen, 0.25, choice)
        assert seen[backend] == [tuple(lengths)] and sum(map(len, seen.values())) == 1


def test_invariant_sub_packs_have_fixed_shapes_per_length(monkeypatch):
    lengths = [64, 16, 64, 300, 64]
    cu, max_seqlen = make_cu_seqlens(lengths)
    plan = sub_packs(pack_info(cu, sum(lengths)), 256, True, torch.device("cpu"))
    shapes = sorted((pack_info(p.cu_seqlens, p.rows.shape[0]).lengths[0], p.rows.shape[0], p.dest.shape[0], p.short)
                    for p in plan)
    assert shapes == [(16, chunk_segments(16) * 16, 16, True), (64, chunk_segments(64) * 64, 192, True),
                      (300, chunk_segments(300) * 300, 300, False)]
    assert [chunk_segments(n) for n in (4, 64, 256, 300, 5476, 20000)] == [128, 128, 32, 27, 1, 1]
    q, k, v = _qkv(sum(lengths))
    choice = BackendChoice(B.TORCH_SDPA, B.NAIVE, 256, batch_invariant=True)
    out = attend(q, k, v, cu, max_seqlen, 0.25, choice)
    torch.testing.assert_close(out, NaiveBackend.forward(q, k, v, cu, max_seqlen, 0.25), rtol=1e-5, atol=1e-5)


def test_segment_result_does_not_depend_on_the_pack():
    choice = BackendChoice(B.TORCH_SDPA, batch_invariant=True)
    q, k, v = _qkv(40, seed=1)
    cu, m = make_cu_seqlens([40])
    alone = attend(q, k, v, cu, m, 0.25, choice)
    for before, after in (([7, 40], []), ([40, 3], [40, 5]), ([], [40, 40, 13])):
        parts = [_qkv(n, seed=n) for n in before] + [[q, k, v]] + [_qkv(n, seed=n + 1) for n in after]
        qq, kk, vv = (torch.cat([p[i] for p in parts]) for i in range(3))
        cu, m = make_cu_seqlens([*before, 40, *after])
        start = sum(before)
        got = attend(qq, kk, vv, cu, m, 0.25, choice)[start:start + 40]
        assert torch.equal(got, alone), f"segment of 40 after {before}, before {after} differs"


def test_shape_independent_backend_runs_each_class_at_once(monkeypatch):
    """A backend declaring shape_independent gets its whole class in one call in batch-invariant mode
    (a view of the pack when the class is the pack: no copy), and a segment's result is unchanged."""
    monkeypatch.setattr(NaiveBackend, "shape_independent", True)
    seen = _spy(monkeypatch)
    calls = []
    monkeypatch.setattr(NaiveBackend, "forward_batch_invariant",
                        classmethod(lambda cls, q, *a: calls.append(q.data_ptr()) or cls.forward(q, *a)))
    choice = BackendChoice(B.TORCH_SDPA, B.NAIVE, 8, batch_invariant=True)
    lengths = [5, 20, 3, 8, 20, 2]
    q, k, v = _qkv(sum(lengths))
    cu, max_seqlen = make_cu_seqlens(lengths)
    out = attend(q, k, v, cu, max_seqlen, 0.25, choice)
    assert seen["NAIVE"] == [(5, 3, 8, 2)]  # the short class at once, no chunks or padding copies
    assert all(n == 20 for lengths_ in seen["TORCH_SDPA"] for n in lengths_)  # long ones: fixed chunks
    torch.testing.assert_close(out, NaiveBackend.forward(q, k, v, cu, max_seqlen, 0.25), rtol=1e-5, atol=1e-5)
    calls.clear()
    short = [5, 3, 8]
    q2, k2, v2 = _qkv(16, seed=3)
    cu2, m2 = make_cu_seqlens(short)
    alone = attend(q2[5:8], k2[5:8], v2[5:8], *make_cu_seqlens([3]), 0.25, choice)
    got = attend(q2, k2, v2, cu2, m2, 0.25, choice)
    assert calls[-1] == q2.data_ptr()  # the pack itself, not a gathered copy
    assert torch.equal(got[5:8], alone)


def test_platform_chooses_only_invariant_backends(monkeypatch):
    h100 = CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(9, 0)))
    monkeypatch.setattr(get_backend_class(B.TRITON_ATTN), "is_installed", classmethod(lambda cls: True))
    choice = h100.choose_vit_attn(80, torch.bfloat16, batch_invariant=True)
    # TRITON_ATTN's fixed-config path (shape-independent) runs the windows, as in the default mode
    assert choice.batch_invariant and choice.short == B.TRITON_ATTN
    assert get_backend_class(B.TRITON_ATTN).shape_independent
    for backend in (choice.main, choice.short or choice.main):
        assert get_backend_class(backend).not_batch_invariant is None
    for backend in (B.FLEX_ATTENTION, B.PALLAS):
        reasons = get_backend_class(backend).unsupported_reasons(80, torch.bfloat16, h100.device_info(), True)
        assert any(r.startswith("not batch invariant: ") for r in reasons), reasons
    with pytest.raises(ValueError, match=r"FLEX_ATTENTION cannot run .*batch-invariantly.*not batch invariant"):
        h100.get_vit_attn_backend(80, torch.bfloat16, "FLEX_ATTENTION", batch_invariant=True)
    assert "batch-invariant" in choice.describe()


# -- GPU (bf16): the coordinator runs these on a CUDA machine ------------------------------------

GPU_TARGET, GPU_OTHERS = (1, 16, 16), [(1, 8, 8), (1, 74, 74), (1, 32, 32), (1, 16, 16)]


def _gpu_calls():
    small, large, mid, same = GPU_OTHERS
    return [([small, GPU_TARGET], 1, None), ([GPU_TARGET, large], 0, None), ([large, mid, GPU_TARGET, small], 2, None),
            ([same, mid, GPU_TARGET, large, small], 2, None), ([large, small, GPU_TARGET, mid], 2, 6000)]


def _gpu_worst_difference(model: str, case: ck.FamilyCase, mode: str, tile: int | None = None) -> float:
    """Largest |difference| over _gpu_calls() between GPU_TARGET's outputs alone and in each call;
    `tile`: the linears' token tile instead of the default (mmenc.layers.linear_kernels.use_token_tiles)."""
    enc = Encoder(model, load_format="dummy", dtype="bfloat16", device="cuda", batch_invariant=True,
                  compile=mode != "eager", cuda_graphs=mode == "graphs")
    if tile is not None:
        from mmenc.layers.linear_kernels import use_token_tiles

        use_token_tiles(enc.tower, tile)
    runs = 3 if mode == "graphs" else 1  # graphs: warm-up, capture, then the replay is checked

    def encode(grids, index, max_patches=None):
        enc.max_batch_patches = max_patches or (1 << 16)
        pixels, grid = _pixels(case, grids)
        for _ in range(runs):
            out = enc.encode_pixels(pixels.cuda(), grid, return_extras=True)
        return [t.clone() for t in _per_image(enc, out, grid, index)]

    alone = encode([GPU_TARGET], 0)
    worst = 0.0
    for grids, index, max_patches in _gpu_calls():
        got = encode(grids, index, max_patches)
        worst = max([worst] + [float((a.float() - b.float()).abs().max()) for a, b in zip(alone, got)])
    return worst


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["eager", "compile", "graphs"])
def test_gpu_tower_is_batch_invariant(mode):
    """Qwen2.5-VL-7B's tower (random weights, bf16): eager, compiled, compiled + CUDA graphs."""
    worst = _gpu_worst_difference("Qwen/Qwen2.5-VL-7B-Instruct", ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"],
                                  mode)
    assert worst == 0.0, f"{mode}: an image's embedding changed with the batch by up to {worst:.3e}"


def _random_image(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth random RGB uint8 image [height, width, 3] (the same bytes for the same arguments)."""
    rng = np.random.default_rng(seed)
    small = torch.from_numpy(rng.random((1, 3, max(height // 16, 2), max(width // 16, 2)), dtype=np.float32))
    big = torch.nn.functional.interpolate(small, size=(height, width), mode="bilinear", align_corners=False)
    return (big[0].permute(1, 2, 0).numpy() * 255).round().clip(0, 255).astype(np.uint8)


def _assert_invariant_through_preprocessing(enc: Encoder, calls: list[tuple[list[str], int, int | None]],
                                            what: str) -> None:
    """Encode the target image (300 x 420) alone, then in each call: (images by name: "target", "small"
    90 x 120, "large" 640 x 520; the target's index; max_batch_patches or None), and require the target's
    embedding bitwise equal to the one alone."""
    images = {"target": _random_image(300, 420, 1), "small": _random_image(90, 120, 2),
              "large": _random_image(640, 520, 3)}
    alone = enc.encode([images["target"]])[0]
    for names, index, max_patches in calls:
        enc.max_batch_patches = max_patches or (1 << 16)
        got = enc.encode([images[n] for n in names])[index]
        assert got.shape == alone.shape, f"{what}: {tuple(got.shape)} vs alone {tuple(alone.shape)}"
        diff = float((got.float() - alone.float()).abs().max())
        assert torch.equal(got, alone), (f"{what}, images {names} (max_batch_patches={max_patches}): the target's "
                                         f"embedding differs by up to {diff:.3e}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", sorted(ck.FAMILIES))
def test_gpu_every_family_is_batch_invariant_eager(arch):
    """One built-in model of every registered architecture, full size, random weights, bf16, eager, through
    the model's own preprocessing (images in, so fixed-size towers get their own tiles/crops): an image's
    embedding alone equals it beside smaller and larger images, in another order, and chunked."""
    from mmenc.models.registry import builtin_model_names

    case = ck.FAMILIES[arch]
    model = min(n for n in builtin_model_names() if n.startswith(case.builtin_prefix))
    enc = Encoder(model, load_format="dummy", dtype="bfloat16", device="cuda", batch_invariant=True)
    _assert_invariant_through_preprocessing(enc, [(["small", "target"], 1, None), (["target", "large", "small"], 0, None),
                                                  (["large", "small", "target"], 2, None),
                                                  (["small", "large", "target", "small"], 2, 2048)], model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1176, 1280), (1280, 3840), (1280, 1280), (1280, 6840), (3420, 1280),
                                   (5120, 5120), (5120, 3584)])
def test_gpu_tile_gemm_row_position(shape):
    """The tile GEMM (Qwen2.5-VL-7B tower shapes (in, out), bf16: patch embedding, qkv, proj, gate_up, down,
    merger) gives a row the same bits at any position in the tile, with the tile size the tower uses for
    the shape (narrow linears: NARROW_TOKEN_TILE; 3420 inputs: zero-padded to 3424)."""
    from mmenc.layers.token_tiles import NARROW_OUT_FEATURES, NARROW_TOKEN_TILE, TOKEN_TILE

    tile = NARROW_TOKEN_TILE if shape[1] < NARROW_OUT_FEATURES else TOKEN_TILE
    _assert_rows_keep_their_bits(shape, tile, ((1, 3000), (tile - 20, 2 * tile + 5), (5000, 9000), (129, 300)))


def _assert_rows_keep_their_bits(shape: tuple[int, int], tile: int, placements, close_to_linear: bool = False) -> None:
    """37 random bf16 rows through tiled_linear(x, w, b, tile) [in, out = shape] alone, then placed at each
    (offset, total rows) of `placements` among other rows: their outputs must be bitwise the same.
    close_to_linear: the alone result is also checked against F.linear (bf16 tolerance)."""
    n_in, n_out = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(n_out, n_in, device="cuda", dtype=torch.bfloat16, generator=g) * n_in ** -0.5
    b = torch.randn(n_out, device="cuda", dtype=torch.bfloat16, generator=g)
    rows = torch.randn(37, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
    alone = tiled_linear(rows, w, b, tile)
    if close_to_linear:
        torch.testing.assert_close(alone.float(), torch.nn.functional.linear(rows, w, b).float(), rtol=2e-2, atol=2e-2)
    for offset, total in placements:
        x = torch.randn(total, n_in, device="cuda", dtype=torch.bfloat16, generator=g)
        x[offset:offset + 37] = rows
        got = tiled_linear(x, w, b, tile)[offset:offset + 37]
        diff = float((got.float() - alone.float()).abs().max())
        assert torch.equal(got, alone), f"shape {shape}: rows at {offset} of {total} differ by up to {diff:.3e}"


@pytest.mark.slow
def test_compiled_cpu_tower_is_batch_invariant(tmp_path):
    """Inductor's reductions (norms over the hidden size) stay per row when the token count changes:
    the first call compiles static shapes, the next recompile with a dynamic one (about 2 minutes)."""
    pytest.importorskip("transformers")
    case = ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"]
    enc = Encoder(str(case.save(tmp_path)[0]), device="cpu", batch_invariant=True, compile=True)
    pixels, grid = _pixels(case, [TARGET])
    alone = _per_image(enc, enc.encode_pixels(pixels, grid, return_extras=True), grid, 0)
    for grids, index, max_patches in CALLS[:3]:
        pixels, grid = _pixels(case, grids)
        out = enc.encode_pixels(pixels, grid, return_extras=True)
        _assert_equal(alone, _per_image(enc, out, grid, index), f"compiled, call {grids}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1176, 1280), (1280, 3840), (1280, 1280), (1280, 6840), (3420, 1280),
                                   (5120, 5120), (5120, 3584)])
def test_gpu_triton_gemm_rows_do_not_depend_on_the_row_count(shape):
    """The opt-in Triton GEMM (tile=TRITON_GEMM): a row's bits are the same for any row count and position."""
    from mmenc.layers.token_tiles import TRITON_GEMM

    _assert_rows_keep_their_bits(shape, TRITON_GEMM, ((1, 3000), (4076, 8197), (5000, 43808), (129, 300)),
                                 close_to_linear=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["eager", "graphs"])
def test_gpu_tower_is_batch_invariant_with_the_triton_gemm(mode):
    """Qwen2.5-VL-7B's tower with every linear on the Triton GEMM instead of token tiles."""
    from mmenc.layers.token_tiles import TRITON_GEMM

    worst = _gpu_worst_difference("Qwen/Qwen2.5-VL-7B-Instruct", ck.FAMILIES["Qwen2_5_VLForConditionalGeneration"],
                                  mode, tile=TRITON_GEMM)
    assert worst == 0.0, f"{mode}: an image's embedding changed with the batch by up to {worst:.3e}"


# Tiny checkpoints whose saved processor config does not fit their tiny tower (images in cannot run).
_PROCESSOR_MISMATCH = {
    "Llama4ForConditionalGeneration": "the tiny checkpoint's processor tiles do not match its tiny tower",
    "Ovis2ForConditionalGeneration": "the tiny checkpoint's processor does not match its tiny tower",
}


@pytest.mark.parametrize("arch", sorted(ck.FAMILIES))
def test_cpu_every_family_is_batch_invariant_through_preprocessing(arch, tmp_path):
    """CPU fp32, images in through the model's own preprocessing (hundreds of tokens per image, as the GPU
    test): an image's embedding alone equals it beside smaller and larger images, in another order and
    chunked. Catches what small grids miss: torch's fused CPU activations computing a tensor's (parallel
    chunk's) last elements with scalar code, so a token's bits moved with the others' count."""
    pytest.importorskip("transformers")
    if arch in _PROCESSOR_MISMATCH:
        pytest.skip(_PROCESSOR_MISMATCH[arch])
    case = ck.FAMILIES[arch]
    try:
        folder = str(case.save(tmp_path)[0])
    except ImportError:
        pytest.skip(f"this transformers cannot write {arch}")
    enc = Encoder(folder, device="cpu", batch_invariant=True)
    _assert_invariant_through_preprocessing(enc, [(["target", "large", "small"], 0, None),
                                                  (["large", "small", "target"], 2, None),
                                                  (["small", "large", "target"], 2, 600)], arch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", [torch.nn.GELU(approximate="tanh"), torch.nn.GELU(), torch.nn.SiLU(), QuickGELU()])
def test_invariant_activations_ignore_an_elements_position(act, dtype):
    """Each swapped activation gives an element the same bits at any position and tensor length (torch's
    fused CPU GELU-tanh, GELU, SiLU kernels do not: scalar code on each chunk's last elements), and stays
    close to torch's own."""
    holder = torch.nn.Sequential(act)
    assert use_invariant_activations(holder) == 1 and isinstance(holder[0], InvariantActivation)
    g = torch.Generator().manual_seed(0)
    v = (torch.randn(6000, generator=g) * 3).to(dtype)
    full = holder(v)
    torch.testing.assert_close(full.float(), act(v).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    for offset, length in [(0, 1), (0, 31), (1, 33), (7, 63), (33, 65), (5, 1000), (17, 4097), (0, 5999)]:
        got = holder(v[offset:offset + length])
        assert torch.equal(got, full[offset:offset + length]), f"{holder[0]}: elements {offset}+{length} differ"
    rows = v[:37 * 40].reshape(40, 37)  # a [T, I] tensor with a width that is no multiple of the vector width
    assert torch.equal(holder(rows[3:11]), holder(rows)[3:11])


def test_invariant_activations_only_on_cpu_invariant_towers(tmp_path):
    pytest.importorskip("transformers")
    folder = str(ck.FAMILIES["Siglip2Model"].save(tmp_path)[0])
    kinds = {m.kind for m in Encoder(folder, device="cpu", batch_invariant=True).tower.modules()
             if isinstance(m, InvariantActivation)}
    assert kinds == {"gelu_tanh"}  # the blocks' MLPs and the attention-pooling head's
    plain = Encoder(folder, device="cpu").tower
    assert not any(isinstance(m, InvariantActivation) for m in plain.modules())
    with pytest.raises(ValueError, match="not an invariant activation"):
        InvariantActivation("relu")
