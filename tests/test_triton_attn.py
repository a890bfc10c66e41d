"""TRITON_ATTN against the NAIVE oracle.

* GPU tests (`gpu` marker): bf16/fp16, head sizes 17/64/72/80/128, GQA, windows, long segments.
* Interpreter tests: without CUDA but with triton installed, the kernel runs on Triton's CPU
  interpreter (TRITON_INTERPRET=1, set below before the kernel module is imported). The
  interpreter's tl.dot is wrong for bf16, so they use fp16 and fp32. They skip without triton.
* Host-side pieces (tile table, head split, reasons, fake op) need neither.
"""
import importlib.util
import os

import pytest
import torch

from mmenc.backends import AttentionBackendEnum
from mmenc.backends import DeviceInfo, get_backend_class
from mmenc.backends.naive import NaiveBackend
from mmenc.backends.packing import PackInfo, make_cu_seqlens

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
if HAS_TRITON and not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel module imports triton

from mmenc.backends.kernels import triton_varlen_attn as tva

gpu = pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
TOL = 2e-2


def _pack(lengths, hq, hkv, d, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cu, max_seqlen = make_cu_seqlens(lengths, device)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, generator=gen).to(device, dtype) for h in (hq, hkv, hkv))
    return q, k, v, cu, max_seqlen


def _check(out, q, k, v, cu, max_seqlen, what, tol=TOL):
    ref = NaiveBackend.forward(q, k, v, cu, max_seqlen, q.shape[-1] ** -0.5)
    assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape}/{out.dtype} vs {ref.shape}"
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert err < tol, f"{what}: relative error {err:.3e} >= tolerance {tol:.0e}"


# ---------------------------------------------------------------- host side (always runs)

@pytest.mark.parametrize("lengths", [[5], [1, 0, 7, 30, 2, 2, 2, 0], [40, 3, 3, 65, 1], [16] * 9, [0, 0, 4]])
@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (64, 32)])
def test_tile_table_covers_each_row_once(lengths, block_m, block_n):
    info = PackInfo(tuple(lengths), max(lengths))
    tiles, seg_ids = tva.tile_table(info, block_m, block_n, torch.device("cpu"))
    starts = info.starts()
    seg_of = [s for s, n in enumerate(lengths) for _ in range(n)]
    assert seg_ids.tolist() == seg_of
    seen = [0] * sum(lengths)
    for q_lo, q_hi, kv_lo, kv_hi, n_full in tiles.tolist():
        assert 0 < q_hi - q_lo <= block_m, (q_lo, q_hi)
        segs = set(seg_of[q_lo:q_hi])
        # the KV range is exactly the segments of the tile's rows; unmasked blocks only for one segment
        first, last = min(segs), max(segs)
        assert (kv_lo, kv_hi) == (starts[first], starts[last] + lengths[last]), (q_lo, q_hi, kv_lo, kv_hi)
        assert n_full == ((kv_hi - kv_lo) // block_n if len(segs) == 1 else 0)
        for r in range(q_lo, q_hi):
            seen[r] += 1
    assert seen == [1] * sum(lengths)


def test_tile_table_cached_per_pack():
    cu, _ = make_cu_seqlens([64] * 6)
    from mmenc.backends.packing import pack_info
    info = pack_info(cu, 384)
    a = tva.tile_table(info, 128, 64, torch.device("cpu"))
    assert tva.tile_table(info, 128, 64, torch.device("cpu"))[0] is a[0]
    assert a[0].shape[0] == 3  # two 64-token windows per 128-row tile


@pytest.mark.parametrize("d,expected", [(16, (16, 0)), (17, (32, 0)), (64, (64, 0)), (72, (64, 16)), (80, (64, 16)),
                                        (96, (64, 32)), (112, (128, 0)), (128, (128, 0)), (8, (16, 0))])
def test_head_split(d, expected):
    assert tva.head_split(d) == expected
    da, db = tva.head_split(d, split=False)
    assert db == 0 and da >= d


def test_window_table_and_candidates():
    info = PackInfo((3, 0, 5, 0, 0, 2), 5)
    assert tva.window_table(info, torch.device("cpu")).tolist() == [0, 3, 8, 10]
    assert tva.head_class(72) == tva.head_class(80) == "64+16" and tva.head_class(64) == "64"
    for d in (17, 64, 72, 80, 96, 128, 256):
        for max_seqlen in (64, 1000, 5000):
            configs = tva.candidates(d, max_seqlen)
            assert 1 <= len(configs) <= 2, (d, max_seqlen, configs)


def test_reasons():
    cls = get_backend_class(AttentionBackendEnum.TRITON_ATTN)
    h100 = DeviceInfo(type="cuda", vendor="nvidia", capability=(9, 0))
    extra = [] if HAS_TRITON else ["triton is not installed (pip install triton)"]
    assert cls.unsupported_reasons(80, torch.bfloat16, h100) == extra
    assert any("compute capability >= 8.0" in r for r in
               cls.unsupported_reasons(80, torch.float16, DeviceInfo("cuda", "nvidia", (7, 5))))
    mi300 = DeviceInfo("cuda", "amd", arch="gfx942")
    assert any("ROCm" in r for r in cls.unsupported_reasons(80, torch.float16, mi300))
    assert any("float32" in r for r in cls.unsupported_reasons(80, torch.float32, h100))
    assert any("head_size 300" in r for r in cls.unsupported_reasons(300, torch.float16, h100))


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(10, 4, 72, dtype=torch.bfloat16), torch.empty(10, 2, 72, dtype=torch.bfloat16)
        out = torch.ops.mmenc.triton_varlen_attn(q, k, k, torch.empty(3, dtype=torch.int32), 5, 0.1)
    assert out.shape == (10, 4, 72) and out.dtype == torch.bfloat16


# ---------------------------------------------------------------- interpreter (CPU, triton installed)

def _interpreter_works() -> str | None:
    if not HAS_TRITON:
        return "triton is not installed"
    if HAS_CUDA:
        return "CUDA is present: the GPU tests cover the kernel"
    q, k, v, cu, _ = _pack([3, 2], 1, 1, 16, torch.float32, "cpu")
    from triton.runtime.errors import InterpreterError

    try:
        tva.launch(q, k, v, cu, 0.25, tva.KernelConfig(16, 16))
    except InterpreterError as e:
        if "0-dimensional" in str(e):
            return "this Triton interpreter fails with numpy>=2.4 (int() of 1-element arrays); use numpy<2.4"
        raise
    return None


_INTERP_SKIP = _interpreter_works() if HAS_TRITON and not HAS_CUDA else "needs triton and no CUDA"
interp = pytest.mark.skipif(_INTERP_SKIP is not None, reason=str(_INTERP_SKIP))
SMALL = tva.KernelConfig(block_m=32, block_n=16)


@interp
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("d", [16, 17, 64, 72, 80, 128])
def test_interpreter_head_sizes(d, dtype):
    q, k, v, cu, mx = _pack([1, 5, 70, 3, 0, 20], 2, 2, d, dtype, "cpu", seed=d)
    _check(tva.launch(q, k, v, cu, d ** -0.5, SMALL), q, k, v, cu, mx, f"d={d} {dtype}")


@interp
@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1), (3, 3)])
@pytest.mark.parametrize("config", [SMALL, tva.KernelConfig(16, 16), tva.KernelConfig(64, 32, split=False)])
def test_interpreter_gqa_and_tiles(hq, hkv, config):
    q, k, v, cu, mx = _pack([33, 1, 16, 16, 7, 9, 0, 40], hq, hkv, 80, torch.float16, "cpu", seed=hq + hkv)
    _check(tva.launch(q, k, v, cu, 80 ** -0.5, config), q, k, v, cu, mx, f"hq={hq} hkv={hkv} {config}")


@interp
@pytest.mark.parametrize("d", [24, 72, 80])
@pytest.mark.parametrize("split", [True, False])
def test_interpreter_tma(d, split, monkeypatch):
    """The TMA path (K/V through tensor descriptors; zero fill past T and past the head size)."""
    monkeypatch.setattr(tva, "_tma_ok", lambda *_: True)
    q, k, v, cu, mx = _pack([1, 5, 70, 3, 0, 20, 8, 8, 8], 4, 2, d, torch.float16, "cpu", seed=d)
    config = tva.KernelConfig(32, 16, split=split, tma=True)
    _check(tva.launch(q, k, v, cu, d ** -0.5, config), q, k, v, cu, mx, f"d={d} {config}")


@interp
def test_interpreter_windows_packed():
    q, k, v, cu, mx = _pack([8] * 12 + [5, 8, 3], 2, 1, 72, torch.float16, "cpu")
    _check(tva.launch(q, k, v, cu, 72 ** -0.5, SMALL), q, k, v, cu, mx, "8-token windows in 32-row tiles")


@interp
def test_interpreter_strided_views_and_empty():
    t, h, d = 50, 2, 72
    cu, mx = make_cu_seqlens([20, 1, 29])
    qkv = torch.randn(t, 3, h, d).half()
    q, k, v = qkv.unbind(1)  # strided views, stride(-1) == 1
    _check(tva.launch(q, k, v, cu, d ** -0.5, SMALL), q, k, v, cu, mx, "views of a fused qkv")
    empty = torch.empty(0, h, d, dtype=torch.float16)
    cu0, _ = make_cu_seqlens([0, 0])
    assert tva.launch(empty, empty, empty, cu0, 0.1).shape == (0, h, d)


@interp
def test_interpreter_op_and_backend_and_compile(monkeypatch):
    q, k, v, cu, mx = _pack([9, 1, 30], 4, 2, 64, torch.float16, "cpu")
    for key in tva.CONFIGS:
        monkeypatch.setitem(tva.CONFIGS, key, [SMALL])
    backend = get_backend_class(AttentionBackendEnum.TRITON_ATTN)
    _check(backend.forward(q, k, v, cu, mx, 0.125), q, k, v, cu, mx, "backend.forward")
    compiled = torch.compile(backend.forward, fullgraph=True, backend="eager")
    _check(compiled(q, k, v, cu, mx, 0.125), q, k, v, cu, mx, "torch.compile(fullgraph=True)")


@interp
@pytest.mark.parametrize("d", [16, 17, 72, 80])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_interpreter_windows_kernel(d, hq, hkv):
    """Every segment <= block_m: one single-block softmax per window, several windows per program."""
    q, k, v, cu, mx = _pack([16, 16, 5, 0, 16, 1, 9, 16], hq, hkv, d, torch.float16, "cpu", seed=d + hq)
    config = tva.KernelConfig(16, 16, windows=3)
    _check(tva.launch(q, k, v, cu, d ** -0.5, config), q, k, v, cu, mx, f"d={d} {config}")
    from mmenc.backends.packing import pack_info
    assert ("triton_attn_windows", torch.device("cpu")) in pack_info(cu, q.shape[0]).cache  # the windows path ran


@interp
def test_interpreter_windows_config_falls_back_to_tiles():
    q, k, v, cu, mx = _pack([16, 40, 3], 2, 1, 72, torch.float16, "cpu")  # 40 > block_m: tile kernel
    config = tva.KernelConfig(32, 16, windows=2)
    _check(tva.launch(q, k, v, cu, 72 ** -0.5, config), q, k, v, cu, mx, f"{config} on a 40-token segment")
    from mmenc.backends.packing import pack_info
    assert ("triton_attn_windows", torch.device("cpu")) not in pack_info(cu, q.shape[0]).cache


@interp
def test_interpreter_windows_strided_views():
    t, h, d = 45, 2, 72
    cu, mx = make_cu_seqlens([16, 13, 16])
    q, k, v = torch.randn(t, 3, h, d).half().unbind(1)
    _check(tva.launch(q, k, v, cu, d ** -0.5, tva.KernelConfig(16, 16, windows=2)), q, k, v, cu, mx, "windows, views")


# ---------------------------------------------------------------- batch-invariant mode (fixed configs)

def _alone_and_in_packs(run, length, hq, hkv, d, dtype, device):
    """(segment alone, [the same segment's rows inside packs with other segments around it]) via run."""
    q, k, v, cu, _ = _pack([length], hq, hkv, d, dtype, device, seed=length)
    alone = run(q, k, v, cu)
    got = []
    for before, after in (([7, 64], [200]), ([300], [5, 64, 64]), ([1, 65], [])):
        parts = [_pack([n], hq, hkv, d, dtype, device, seed=n + 1)[:3] for n in before] + [(q, k, v)]
        parts += [_pack([n], hq, hkv, d, dtype, device, seed=n + 2)[:3] for n in after]
        qq, kk, vv = (torch.cat([p[i] for p in parts]) for i in range(3))
        cu, _ = make_cu_seqlens([*before, length, *after], device)
        start = sum(before)
        got.append(run(qq, kk, vv, cu)[start:start + length])
    return alone, got


def test_invariant_tables_give_each_segment_its_own_blocks():
    from mmenc.backends.kernels.triton_attn_plan import invariant_configs, segment_tables

    info = PackInfo(lengths=(64, 0, 3, 130, 64, 65), max_seqlen=130)
    windows, tiles, seg_ids = segment_tables(info, 64, 128, 64, torch.device("cpu"))
    assert windows.tolist() == [[0, 64], [64, 67], [197, 261]]  # segments of 1..64 tokens
    # 130 tokens: two tiles cut from its own start, each over its whole segment; 65: one tile of its own
    assert sorted(map(tuple, tiles.tolist())) == [(67, 195, 67, 197, 2), (195, 197, 67, 197, 2),
                                                  (261, 326, 261, 326, 1)]
    assert seg_ids.shape == (326,)
    assert invariant_configs(80)[0].windows and not invariant_configs(80)[1].tma
    assert invariant_configs(80) == invariant_configs(72)  # one pair per head class


@interp
@pytest.mark.parametrize("length", [16, 64, 65, 200])
@pytest.mark.parametrize("d,hq,hkv", [(80, 2, 1), (64, 2, 2)])
def test_interpreter_invariant_segment_is_independent_of_the_pack(length, d, hq, hkv):
    from mmenc.backends.kernels.triton_invariant import varlen_attention_invariant

    def run(q, k, v, cu):
        return varlen_attention_invariant(q, k, v, cu, d ** -0.5)

    alone, got = _alone_and_in_packs(run, length, hq, hkv, d, torch.float32, "cpu")
    q, k, v, cu, mx = _pack([length], hq, hkv, d, torch.float32, "cpu", seed=length)
    _check(alone, q, k, v, cu, mx, f"invariant path, {length} tokens", tol=1e-4)
    for i, g in enumerate(got):
        assert torch.equal(g, alone), f"{length}-token segment, pack {i}: differs from alone"


@interp
def test_interpreter_invariant_dispatch_runs_the_short_class_at_once(monkeypatch):
    """Batch-invariant dispatch with TRITON_ATTN for short segments: the short class is one call (no
    chunks, no padding), a slice of the pack when contiguous; results match the class run apart."""
    from mmenc.backends.choice import BackendChoice
    from mmenc.backends.dispatch import attend
    from mmenc.backends.packing import pack_info, sub_packs

    triton_cls = get_backend_class(AttentionBackendEnum.TRITON_ATTN)
    seen = []
    original = triton_cls.forward_batch_invariant.__func__

    def spy(klass, q, k, v, cu_seqlens, max_seqlen, scale):
        seen.append(pack_info(cu_seqlens, q.shape[0]).lengths)
        return original(klass, q, k, v, cu_seqlens, max_seqlen, scale)

    monkeypatch.setattr(triton_cls, "forward_batch_invariant", classmethod(spy))
    choice = BackendChoice(AttentionBackendEnum.NAIVE, AttentionBackendEnum.TRITON_ATTN, 64, batch_invariant=True)
    lengths = [16, 64, 100, 3, 64]
    q, k, v, cu, mx = _pack(lengths, 2, 1, 80, torch.float32, "cpu")
    out = attend(q, k, v, cu, mx, 80 ** -0.5, choice)
    assert seen == [(16, 64, 3, 64)]  # one call for the whole short class
    plan = sub_packs(pack_info(cu, q.shape[0]), 64, True, torch.device("cpu"), frozenset({True}))
    short = [p for p in plan if p.short]
    assert len(short) == 1 and isinstance(short[0].rows, torch.Tensor) and short[0].rows.shape[0] == 147
    _check(out, q, k, v, cu, mx, "invariant dispatch", tol=1e-4)
    seen.clear()
    q2, k2, v2, cu2, mx2 = _pack([16, 64, 3], 2, 1, 80, torch.float32, "cpu")  # all short: the pack itself
    attend(q2, k2, v2, cu2, mx2, 80 ** -0.5, choice)
    assert seen == [(16, 64, 3)]


@interp
def test_interpreter_invariant_gemm_rows_do_not_depend_on_the_row_count():
    """The opt-in Triton GEMM of batch-invariant mode (mmenc.layers.invariant_gemm), here because this
    module sets up Triton's interpreter: rows equal alone and at any offset of any row count."""
    from mmenc.layers.invariant_gemm import GemmConfig, invariant_linear

    config = GemmConfig(32, 32, 16, 2, 4, 2)
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(40, 50, generator=g), torch.randn(40, generator=g), torch.randn(100, 50, generator=g)
    full = invariant_linear(x, w, b, config)
    torch.testing.assert_close(full, torch.nn.functional.linear(x, w, b), rtol=1e-4, atol=1e-4)
    for lo, hi in ((0, 1), (3, 70), (99, 100), (31, 65)):
        assert torch.equal(invariant_linear(x[lo:hi], w, b, config), full[lo:hi]), (lo, hi)
    assert invariant_linear(x[:0], w, None, config).shape == (0, 40)


# ---------------------------------------------------------------- GPU

GPU_PACKS = {
    "mixed": [1, 5, 300, 3, 0, 64, 129, 17],
    "windows": [64] * 40 + [48, 64, 36, 1],
    "long": [3000, 1, 2500],
}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [17, 64, 72, 80, 128])
@pytest.mark.parametrize("pack", sorted(GPU_PACKS))
def test_gpu_against_naive(pack, d, dtype):
    q, k, v, cu, mx = _pack(GPU_PACKS[pack], 8, 8, d, dtype, "cuda", seed=d)
    backend = get_backend_class(AttentionBackendEnum.TRITON_ATTN)
    _check(backend.forward(q, k, v, cu, mx, d ** -0.5), q, k, v, cu, mx, f"{pack} d={d} {dtype}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(16, 4), (16, 1), (12, 12)])
@pytest.mark.parametrize("key", sorted(tva.CONFIGS))
@pytest.mark.parametrize("pack", ["mixed", "windows"])
def test_gpu_every_config_and_gqa(hq, hkv, key, pack):
    d = {"any": 80}.get(key[1]) or sum(int(x) for x in key[1].split("+")) - 8  # a size of the class: 72, 120
    q, k, v, cu, mx = _pack(GPU_PACKS[pack], hq, hkv, d, torch.bfloat16, "cuda")
    for config in tva.CONFIGS[key]:
        _check(tva.launch(q, k, v, cu, d ** -0.5, config), q, k, v, cu, mx, f"{config} d={d} hq={hq} hkv={hkv}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [17, 64, 72, 80, 128])
@pytest.mark.parametrize("config", [tva.KernelConfig(64, 64, 4, 3, windows=4),
                                    tva.KernelConfig(64, 64, 4, 2, windows=8),
                                    tva.KernelConfig(128, 64, 8, 2, windows=2)])
def test_gpu_windows_kernel(d, config):
    q, k, v, cu, mx = _pack(GPU_PACKS["windows"] + [17, 64, 5], 16, 4, d, torch.float16, "cuda", seed=d)
    _check(tva.launch(q, k, v, cu, d ** -0.5, config), q, k, v, cu, mx, f"d={d} {config}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [72, 80, 128])
@pytest.mark.parametrize("tma", [False, True])
def test_gpu_tma_and_pointer_paths(d, tma):
    q, k, v, cu, mx = _pack(GPU_PACKS["mixed"] + [64] * 5, 16, 4, d, torch.bfloat16, "cuda")
    for config in (tva.KernelConfig(128, 64, 8, 3, tma=tma), tva.KernelConfig(64, 64, 4, 2, split=False, tma=tma)):
        _check(tva.launch(q, k, v, cu, d ** -0.5, config), q, k, v, cu, mx, f"d={d} {config}")


@gpu
@pytest.mark.gpu
def test_gpu_strided_and_compile():
    t, h, d = 700, 16, 80
    cu, mx = make_cu_seqlens([64] * 10 + [60])
    qkv = torch.randn(t, 3, h, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    backend = get_backend_class(AttentionBackendEnum.TRITON_ATTN)
    _check(backend.forward(q, k, v, cu, mx, d ** -0.5), q, k, v, cu, mx, "views of a fused qkv")
    compiled = torch.compile(backend.forward, fullgraph=True)
    _check(compiled(q, k, v, cu, mx, d ** -0.5), q, k, v, cu, mx, "torch.compile(fullgraph=True)")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 72, 80, 128])
@pytest.mark.parametrize("length", [4, 16, 64, 65, 100, 256, 300, 1024])
def test_gpu_invariant_segment_is_independent_of_the_pack(d, length):
    """TRITON_ATTN's batch-invariant path (bf16): a segment's rows are bitwise the same alone, inside
    packs of other segments, and read through strided views of a fused qkv."""
    from mmenc.backends.kernels.triton_invariant import varlen_attention_invariant

    def run(q, k, v, cu):
        return varlen_attention_invariant(q, k, v, cu, d ** -0.5)

    alone, got = _alone_and_in_packs(run, length, 16, 16, d, torch.bfloat16, "cuda")
    q, k, v, cu, mx = _pack([length], 16, 16, d, torch.bfloat16, "cuda", seed=length)
    _check(alone, q, k, v, cu, mx, f"invariant path d={d}, {length} tokens")
    for i, g in enumerate(got):
        diff = float((g.float() - alone.float()).abs().max())
        assert torch.equal(g, alone), f"d={d}, {length}-token segment, pack {i}: differs by up to {diff:.3e}"
    fused = torch.stack([q, k, v], dim=1)  # [T, 3, H, D]: the tower's layout
    viewed = run(*fused.unbind(1), cu)
    assert torch.equal(viewed, alone), f"d={d}, {length} tokens: strided views differ from contiguous inputs"
