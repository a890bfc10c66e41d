"""mmenc.layers.compiled_norm: RMSNorm through an Inductor-compiled kernel on the CPU. Same values as
torch's rms_norm; small inputs never compile; a compile failure falls back to the reference, said once; the
CPU platform turns it on for towers (not for compiled or batch-invariant ones)."""
import pytest
import torch
import torch.nn.functional as F

from mmenc.layers import compiled_norm
from mmenc.layers.norm import RMSNorm


@pytest.fixture
def fresh_state(monkeypatch):
    monkeypatch.setattr(compiled_norm, "_state", {"fn": None, "failed": False})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_compiled_rms_norm_equals_torchs(dtype, fresh_state):
    torch.manual_seed(0)
    x = torch.randn(300, 1024).to(dtype)  # 307,200 elements: over MIN_ELEMENTS
    w = torch.randn(1024).to(dtype)
    assert x.numel() >= compiled_norm.MIN_ELEMENTS
    want = F.rms_norm(x.double(), (1024,), w.double(), 1e-6)
    got = compiled_norm.rms_norm(x, w, 1e-6)
    assert compiled_norm._state["fn"] is not None and not compiled_norm._state["failed"]
    assert got.dtype == dtype and got.shape == x.shape
    eager = F.rms_norm(x, (1024,), w, 1e-6)
    err = lambda t: ((t.double() - want).norm() / want.norm()).item()  # noqa: E731
    assert err(got) <= err(eager) * 1.01 + 1e-7, (err(got), err(eager))  # no worse than torch's own
    three_d = compiled_norm.rms_norm(x.view(3, 100, 1024), w, 1e-6)
    assert torch.equal(three_d.view(300, 1024), got)


def test_small_inputs_run_the_reference_and_failures_fall_back(fresh_state, monkeypatch, caplog):
    x, w = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(compiled_norm.rms_norm(x, w, 1e-6), F.rms_norm(x, (64,), w, 1e-6))
    assert compiled_norm._state["fn"] is None  # nothing compiled for it

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler here")
    monkeypatch.setattr(compiled_norm, "_state", {"fn": broken, "failed": False})
    big = torch.randn(512, 1024)
    with caplog.at_level("WARNING", logger="mmenc"):
        out = compiled_norm.rms_norm(big, torch.ones(1024), 1e-6)
        again = compiled_norm.rms_norm(big, torch.ones(1024), 1e-6)
    assert torch.equal(out, F.rms_norm(big, (1024,), torch.ones(1024), 1e-6)) and torch.equal(out, again)
    assert compiled_norm._state["failed"]
    assert sum("compiled RMSNorm unavailable (RuntimeError: no C++ compiler here)" in r.getMessage()
               for r in caplog.records) == 1


def test_use_compiled_norms_sets_every_rmsnorm():
    layers = torch.nn.Sequential(RMSNorm(8), torch.nn.Linear(8, 8), RMSNorm(8))
    assert compiled_norm.use_compiled_norms(layers) == 2
    assert all(m.kernel is compiled_norm.rms_norm for m in layers if isinstance(m, RMSNorm))
    x = torch.randn(3, 8)
    assert torch.equal(layers[0](x), F.rms_norm(x, (8,), layers[0].weight, 1e-6))


def test_cpu_towers_get_the_compiled_norm_unless_compiled_or_invariant(q25):
    from mmenc.engine.encoder import Encoder

    def kernels(enc):
        return {m.kernel for m in enc.loaded.tower.modules() if isinstance(m, RMSNorm)}
    with Encoder(q25, device="cpu") as enc:
        assert kernels(enc) == {compiled_norm.rms_norm}
    with Encoder(q25, device="cpu", batch_invariant=True) as enc:
        assert kernels(enc) == {None}


def test_warm_compiles_for_wide_norms_only(fresh_state):
    import torch._dynamo.utils as dynamo_utils

    wide, narrow = RMSNorm(256).to(torch.bfloat16), RMSNorm(64)  # 256 x WARM_ROWS reaches MIN_ELEMENTS; 64 does not
    layers = torch.nn.Sequential(wide, narrow)
    assert compiled_norm.warm(layers) == []  # neither runs the compiled kernel yet
    compiled_norm.use_compiled_norms(layers)
    assert compiled_norm.warm(layers) == ["bfloat16 x 256"]
    graphs = dynamo_utils.counters["stats"]["unique_graphs"]
    with torch.inference_mode():  # another row count, made and normed in inference mode as in a tower: no compile
        x = torch.randn(5000, 256).to(torch.bfloat16)
        got = compiled_norm.rms_norm(x, wide.weight, wide.eps)
    torch.testing.assert_close(got, F.rms_norm(x, (256,), wide.weight, wide.eps))  # bf16's rounding apart
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs


def test_encoder_warm_up_says_what_it_did(q25):
    from mmenc.engine.encoder import Encoder

    with Encoder(q25, device="cpu") as enc:  # the tiny tower's norms are narrow: nothing to compile
        assert enc.warm_up() == "nothing to warm up"
