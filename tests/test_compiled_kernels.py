"""mmenc.layers.compiled_kernels: RMSNorm and QuickGELU through Inductor-compiled kernels on the CPU. Same
values as torch's eager forms (no worse against float64); small inputs never compile; a compile failure falls
back to the eager form, said once; the CPU platform turns them on for towers (not for compiled or
batch-invariant ones); warm() compiles ahead for wide towers only."""
import pytest
import torch
import torch.nn.functional as F

from mmenc.layers import compiled_kernels as ck
from mmenc.layers.activation import QuickGELU
from mmenc.layers.norm import RMSNorm


@pytest.fixture
def fresh(monkeypatch):
    """Both kernels as a new process has them (nothing compiled, no failure)."""
    for kernel in (ck.rms_norm, ck.quick_gelu):
        monkeypatch.setattr(kernel, "fn", None)
        monkeypatch.setattr(kernel, "failed", False)


def _err(t: torch.Tensor, want: torch.Tensor) -> float:
    return ((t.double() - want).norm() / want.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_rms_norm_equals_torchs(dtype, fresh):
    torch.manual_seed(0)
    x = torch.randn(300, 1024).to(dtype)  # 307,200 elements: over MIN_ELEMENTS
    w = torch.randn(1024).to(dtype)
    assert x.numel() >= ck.MIN_ELEMENTS
    want = F.rms_norm(x.double(), (1024,), w.double(), 1e-6)
    got = ck.rms_norm(x, w, 1e-6)
    assert ck.rms_norm.fn is not None and not ck.rms_norm.failed
    assert got.dtype == dtype and got.shape == x.shape
    eager = F.rms_norm(x, (1024,), w, 1e-6)
    assert _err(got, want) <= _err(eager, want) * 1.01 + 1e-7, (_err(got, want), _err(eager, want))
    three_d = ck.rms_norm(x.view(3, 100, 1024), w, 1e-6)
    assert torch.equal(three_d.view(300, 1024), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_quick_gelu_equals_torchs(dtype, fresh):
    torch.manual_seed(0)
    x = (3 * torch.randn(300, 1024)).to(dtype)
    want = x.double() * torch.sigmoid(1.702 * x.double())
    eager = QuickGELU()(x)
    got = ck.quick_gelu(x)
    assert ck.quick_gelu.fn is not None and got.dtype == dtype and got.shape == x.shape
    assert _err(got, want) <= _err(eager, want) * 1.01 + 1e-7, (_err(got, want), _err(eager, want))
    if dtype == torch.float32:
        torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)


def test_small_inputs_run_the_reference_and_failures_fall_back(fresh, monkeypatch, caplog):
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(ck.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    assert torch.equal(ck.quick_gelu(x), QuickGELU()(x))
    assert ck.rms_norm.fn is None and ck.quick_gelu.fn is None  # nothing compiled for them

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(ck.rms_norm, "fn", broken)
    big = torch.randn(512, 1024)
    with caplog.at_level("WARNING", logger="mmenc"):
        out = ck.rms_norm(big, torch.ones(1024), 1e-6)
        again = ck.rms_norm(big, torch.ones(1024), 1e-6)
    assert torch.equal(out, F.rms_norm(big, (1024,), torch.ones(1024), 1e-6)) and torch.equal(out, again)
    assert ck.rms_norm.failed and not ck.quick_gelu.failed
    assert sum("compiled RMSNorm unavailable (RuntimeError: no C++ compiler here)" in r.getMessage()
               for r in caplog.records) == 1


def test_use_compiled_kernels_sets_every_rmsnorm_and_quick_gelu():
    layers = torch.nn.Sequential(RMSNorm(8), torch.nn.Linear(8, 8), QuickGELU(), RMSNorm(8), torch.nn.GELU())
    assert ck.use_compiled_kernels(layers) == 3
    assert layers[0].kernel is ck.rms_norm and layers[3].kernel is ck.rms_norm and layers[2].kernel is ck.quick_gelu
    x = torch.randn(3, 8)
    assert torch.equal(layers[0](x), F.rms_norm(x, (8,), layers[0].weight, 1e-6))
    assert torch.equal(layers[2](x), x * torch.sigmoid(1.702 * x))


def test_cpu_towers_get_the_compiled_kernels_unless_compiled_or_invariant(q25):
    from mmenc.engine.encoder import Encoder

    def kernels(enc):
        return {m.kernel for m in enc.loaded.tower.modules() if isinstance(m, RMSNorm)}
    with Encoder(q25, device="cpu") as enc:
        assert kernels(enc) == {ck.rms_norm}
    with Encoder(q25, device="cpu", batch_invariant=True) as enc:
        assert kernels(enc) == {None}


def test_warm_compiles_for_wide_layers_only(fresh):
    import torch._dynamo.utils as dynamo_utils

    wide, narrow = RMSNorm(256).to(torch.bfloat16), RMSNorm(64)  # 256 x WARM_ROWS reaches MIN_ELEMENTS; 64 does not
    layers = torch.nn.Sequential(wide, narrow)
    assert ck.warm(layers) == []  # neither runs the compiled kernel yet
    ck.use_compiled_kernels(layers)
    assert ck.warm(layers) == ["RMSNorm bfloat16 x 256"]
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # another row count, made and normed in inference mode as in a tower: no compile
        x = torch.randn(5000, 256).to(torch.bfloat16)
        got = ck.rms_norm(x, wide.weight, wide.eps)
    torch.testing.assert_close(got, F.rms_norm(x, (256,), wide.weight, wide.eps))  # bf16's rounding apart
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs
    tiny = torch.nn.Sequential(torch.nn.Linear(8, 64), QuickGELU())
    ck.use_compiled_kernels(tiny)
    assert ck.warm(tiny) == []  # its widest linear is 64 wide
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 256), QuickGELU()).to(torch.bfloat16)
    ck.use_compiled_kernels(mlp)
    assert ck.warm(mlp) == ["QuickGELU bfloat16"]
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():
        ck.quick_gelu(torch.randn(3000, 300).to(torch.bfloat16))
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_encoder_warm_up_says_what_it_did(q25):
    from mmenc.engine.encoder import Encoder

    with Encoder(q25, device="cpu") as enc:  # the tiny tower's layers are narrow: nothing to compile
        assert enc.warm_up() == "nothing to warm up"
