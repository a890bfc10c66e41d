"""The fused row kernels (mmenc.backends.kernels.fused_rows) against the reference ops.

On a machine without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, set here before the
kernels are built); without triton the module is skipped. The `gpu` tests run the compiled kernels."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():  # before triton is imported: its jit reads the setting then
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from mmenc.backends.kernels import fused_rows  # noqa: E402
from mmenc.backends.linear.fp8 import FP8_DTYPE, quantize_rows  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def same_rounded(got, want):
    """Equal; in Triton's interpreter within one unit of the last place (its float32 -> bfloat16 cast
    truncates where the GPU's rounds to nearest even)."""
    if not INTERPRETED or got.dtype == torch.float32:
        return torch.equal(got, want)
    ulp = want.float().abs().clamp_min(1e-30) * 2.0 ** -7
    return bool(((got.float() - want.float()).abs() <= ulp).all())


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def ref_norm(x, weight, bias, eps, kind):
    if kind == "rms":
        return F.rms_norm(x, weight.shape, weight, eps)
    return F.layer_norm(x, weight.shape, weight, bias, eps)


def dequant(q, scale, n):
    return q.float()[..., :n] * scale


def assert_fp8_close(q, scale, want):
    """Each dequantized value within e4m3's rounding (half a unit: 2^-4 relative; subnormals: half of
    2^-9 of the scale) of `want`, plus the bfloat16 inputs' own rounding. Triton's interpreter (CPU) does
    not round float32 -> e4m3 as the GPU does (its _convert_float drops a mantissa's carry into the
    exponent, giving the power of two below, and truncates some others): there at least 95% of the
    values must be within that bound and the whole row's relative error below 8%."""
    got = dequant(q, scale, want.shape[-1])
    bound = want.abs() * (2 ** -4 + 2 ** -7) + scale * 2 ** -9 + 1e-6
    ok = (got - want).abs() <= bound
    if INTERPRETED:
        assert ok.float().mean() >= 0.95 and rel(got, want) < 0.08, (ok.float().mean(), rel(got, want))
        return
    bad = (~ok).nonzero()[:4].unbind(1)
    assert bool(ok.all()), (f"{int((~ok).sum())} of {ok.numel()} values off by more than e4m3 rounding: got "
                            f"{got[bad].tolist()}, want {want[bad].tolist()}")


@pytest.mark.parametrize("kind", ["rms", "layer"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(7, 72), (2, 3, 40), (1, 17)])
def test_add_norm_matches_reference(kind, dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    delta = torch.randn(shape, generator=g).to(DEVICE, dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    b = (0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype) if kind == "layer" else None
    y, res = fused_rows.add_norm(x, delta, w, b, 1e-6, kind)
    want_res = x + delta
    assert same_rounded(res, want_res)  # the residual rounded to x's dtype, as the reference
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    err = rel(y, ref_norm(want_res, w, b, 1e-6, kind))
    assert err < tol, f"relative error {err:.2e} >= {tol}"
    assert y.shape == x.shape and y.dtype == dtype


def test_add_norm_reads_strided_rows():
    """A row slice of a wider tensor (what a merged projection's view gives) is read in place."""
    wide = torch.randn(6, 100, device=DEVICE)
    x, delta = wide[:, :40], wide[:, 50:90]
    w = torch.rand(40, device=DEVICE) + 0.5
    y, res = fused_rows.add_norm(x, delta, w, None, 1e-5, "rms")
    assert rel(y, ref_norm(x + delta, w, None, 1e-5, "rms")) < 1e-6
    assert torch.equal(res, x + delta)


@pytest.mark.parametrize("kind", ["rms", "layer"])
def test_norm_fp8_quantizes_per_token(kind):
    g = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(9, 40, generator=g)).to(DEVICE, torch.bfloat16)
    delta = torch.randn(9, 40, generator=g).to(DEVICE, torch.bfloat16)
    w = (1 + 0.1 * torch.randn(40, generator=g)).to(DEVICE, torch.bfloat16)
    b = torch.zeros(40, device=DEVICE, dtype=torch.bfloat16) if kind == "layer" else None
    q, scale = fused_rows.norm_fp8(x, w, b, 1e-6, kind, 48)
    assert q.dtype == FP8_DTYPE and q.shape == (9, 48) and scale.shape == (9, 1) and scale.dtype == torch.float32
    assert torch.count_nonzero(q[:, 40:].view(torch.uint8)) == 0  # the padded K columns are zero
    normed = ref_norm(x.float(), w.float(), None if b is None else b.float(), 1e-6, kind)
    want = quantize_rows(normed, 48)
    assert torch.allclose(scale, want.scale, rtol=1e-5)
    assert_fp8_close(q, scale, normed)
    q2, scale2, res = fused_rows.add_norm_fp8(x, delta, w, b, 1e-6, kind, 48)
    assert same_rounded(res, x + delta)
    want2 = ref_norm((x + delta).float(), w.float(), None if b is None else b.float(), 1e-6, kind)
    assert_fp8_close(q2, scale2, want2)


ACTS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
        "quick_gelu": lambda t: t * torch.sigmoid(1.702 * t)}


@pytest.mark.parametrize("kind", sorted(ACTS))
@pytest.mark.parametrize("gated", [True, False])
def test_act_matches_reference(kind, gated):
    g = torch.Generator().manual_seed(2)
    n = 37
    x = (2 * torch.randn(5, 2 * n if gated else n, generator=g)).to(DEVICE)
    y = fused_rows.act(x, kind, gated)
    gate, up = (x[:, :n], x[:, n:]) if gated else (x, None)
    want = ACTS[kind](gate) * up if gated else ACTS[kind](gate)
    assert y.shape == (5, n)
    assert rel(y, want) < 1e-6
    q, scale = fused_rows.act_fp8(x, kind, gated, 48)
    assert q.shape == (5, 48) and torch.count_nonzero(q[:, n:].view(torch.uint8)) == 0
    assert_fp8_close(q, scale, want)


@pytest.mark.parametrize("gated", [True, False])
def test_act_adds_the_linears_bias(gated):
    """The producing linear's bias, left out of its GEMM, is added inside the activation kernel."""
    g = torch.Generator().manual_seed(3)
    n = 24
    x = torch.randn(6, 2 * n if gated else n, generator=g).to(DEVICE)
    bias = torch.randn(x.shape[-1], generator=g).to(DEVICE)
    xb = x + bias
    want = F.silu(xb[:, :n]) * xb[:, n:] if gated else F.silu(xb)
    assert rel(fused_rows.act(x, "silu", gated, bias), want) < 1e-6
    q, scale = fused_rows.act_fp8(x, "silu", gated, 32, bias)
    assert_fp8_close(q, scale, want)
    with pytest.raises(ValueError, match="bias has shape"):
        fused_rows.act(x, "silu", gated, bias[:5])


def test_act_bf16_and_wide_rows():
    """A row wider than one program's block (Qwen2.5-VL's 3420) spans several column blocks."""
    x = torch.randn(3, 2 * 3420, device=DEVICE, dtype=torch.bfloat16)
    y = fused_rows.act(x, "silu", True)
    want = F.silu(x[:, :3420].float()) * x[:, 3420:].float()
    assert rel(y, want) < 4e-3


def test_bad_arguments_name_the_value():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="norm kind='batch'"):
        fused_rows.add_norm(x, x, torch.ones(8, device=DEVICE), None, 1e-6, "batch")
    with pytest.raises(ValueError, match="activation kind='tanh'"):
        fused_rows.act(x, "tanh", False)
    with pytest.raises(ValueError, match="width=4 is narrower"):
        fused_rows.norm_fp8(x, torch.ones(8, device=DEVICE), None, 1e-6, "rms", 4)
    with pytest.raises(ValueError, match="7 features"):
        fused_rows.act(torch.randn(2, 7, device=DEVICE), "silu", True)


def test_custom_ops_trace_without_graph_breaks():
    """The ops have fake implementations: torch.compile traces through them in one graph."""
    def f(x, d, w):
        y, r = fused_rows.add_norm(x, d, w, None, 1e-6, "rms")
        q, s = fused_rows.act_fp8(torch.cat([y, r], -1), "silu", True, 16)
        return q.float() * s

    x, d, w = torch.randn(4, 16, device=DEVICE), torch.randn(4, 16, device=DEVICE), torch.ones(16, device=DEVICE)
    gm = torch.fx.experimental.proxy_tensor.make_fx(f, tracing_mode="fake")(x, d, w)
    ops = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    assert {"mmenc.fused_add_norm.default", "mmenc.fused_act_fp8.default"} <= ops


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernels_on_gpu_match_interpreter_semantics():
    x = torch.randn(4096, 1280, device="cuda", dtype=torch.bfloat16)
    d = torch.randn_like(x)
    w = torch.rand(1280, device="cuda", dtype=torch.bfloat16) + 0.5
    y, res = fused_rows.add_norm(x, d, w, None, 1e-6, "rms")
    assert torch.equal(res, x + d)
    assert rel(y, ref_norm(x + d, w, None, 1e-6, "rms")) < 8e-3
    h = torch.randn(4096, 6840, device="cuda", dtype=torch.bfloat16)
    q, s = fused_rows.act_fp8(h, "silu", True, 3424)
    want = F.silu(h[:, :3420].float()) * h[:, 3420:].float()
    assert_fp8_close(q, s, want)
