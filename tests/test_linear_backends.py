"""Linear backends (mmenc.backends.linear) against NATIVE (F.linear), the platform's choice and its
reasons, and what preparing does to a layer's weight (replaced, not copied; restorable)."""
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

from mmenc.backends import DeviceInfo, probe_device
from mmenc.backends.linear import LinearBackendEnum as L
from mmenc.backends.linear import get_linear_backend_class
from mmenc.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, ReplicatedLinear
from mmenc.layers.linear_kernels import prepare_linears, restore_linears, use_token_tiles
from mmenc.platforms.cpu import CpuPlatform
from mmenc.platforms.cuda import CudaPlatform

HERE = probe_device("cpu")
RUNNABLE = {dtype: [b for b in (L.NATIVE, L.ONEDNN) if not CpuPlatform().linear_backend_reasons(b, dtype)]
            for dtype in (torch.float32, torch.bfloat16)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_backend_matches_native_on_odd_shapes(dtype):
    torch.manual_seed(0)
    for rows, k, n, bias in [(1, 1, 1, True), (7, 33, 129, True), (17, 72, 5, False), (0, 16, 24, True),
                             (130, 1176, 80, True), (5, 3420, 36, False)]:
        w, b = torch.randn(n, k).to(dtype), (torch.randn(n).to(dtype) if bias else None)
        x = torch.randn(rows, k).to(dtype)
        want = F.linear(x, w, b)
        for backend in RUNNABLE[dtype]:
            cls = get_linear_backend_class(backend)
            state = cls.prepare(w, b)
            assert tuple(state.weight.shape) == (n, k)
            got = cls.apply(state, x)
            assert got.shape == want.shape and got.dtype == dtype, (backend, got.shape, got.dtype)
            if rows:
                err = _rel(got, want)
                assert err < TOL[dtype], f"{backend.name} {rows}x{k}x{n}: relative error {err:.2e} >= {TOL[dtype]}"
            three_d = cls.apply(state, x.view(1, rows, k))  # [..., in] leading dims kept
            assert three_d.shape == (1, rows, n) and torch.equal(three_d[0], got)
            wide = torch.randn(rows, 2 * k).to(dtype)  # a strided view as input
            assert _rel(cls.apply(state, wide[:, ::2]), F.linear(wide[:, ::2], w, b)) < TOL[dtype] or rows == 0


def test_native_stays_bitwise_f_linear():
    torch.manual_seed(1)
    layer = ColumnParallelLinear(40, 24)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(9, 40)
    before = layer(x)
    weight = layer.weight
    assert prepare_linears(layer, L.NATIVE) == 1
    assert layer.weight is weight  # NATIVE keeps the loaded parameter itself
    assert torch.equal(layer(x), before) and torch.equal(layer(x), F.linear(x, weight, layer.bias))


@pytest.mark.skipif(L.ONEDNN not in RUNNABLE[torch.float32], reason="oneDNN cannot run here")
def test_onednn_replaces_the_weight_without_a_copy():
    torch.manual_seed(2)
    layer = MergedColumnParallelLinear(64, [100, 100], prefix="mlp.gate_up_proj")
    for i in range(2):
        layer.weight.weight_loader(layer.weight, torch.randn(100, 64), i)
        layer.bias.weight_loader(layer.bias, torch.randn(100), i)
    x = torch.randn(11, 64)
    want, plain = layer(x), layer.weight.detach().clone()
    gone = weakref.ref(layer.weight)
    prepare_linears(layer, L.ONEDNN)
    gc.collect()
    assert gone() is None, "the loaded weight is still referenced after packing"
    assert layer.weight.is_mkldnn and tuple(layer.weight.shape) == (200, 64)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    nbytes = get_linear_backend_class(L.ONEDNN).state_nbytes(layer.linear_state)
    assert nbytes <= 1.35 * (plain.nbytes + layer.bias.nbytes), nbytes  # 200 rows pad to 256 here
    assert _rel(layer(x), want) < 1e-5
    with pytest.raises(ValueError, match=r"mlp.gate_up_proj.weight is packed for the ONEDNN linear backend"):
        layer.weight.weight_loader(layer.weight, torch.zeros(100, 64), 0)
    with pytest.raises(ValueError, match=r"token tiles run on plain weights"):
        use_token_tiles(layer)
    assert restore_linears(layer) is get_linear_backend_class(L.ONEDNN)
    assert not layer.weight.is_mkldnn and torch.equal(layer.weight, plain) and layer.linear_state is None
    layer.weight.weight_loader(layer.weight, torch.zeros(100, 64), 0)  # loading works again
    assert torch.equal(layer.weight[:100], torch.zeros(100, 64))


def test_patch_embed_loader_survives_prepare_and_restore():
    from mmenc.layers.vision_blocks import PatchEmbed

    embed = PatchEmbed(12, 8)
    backend = RUNNABLE[torch.float32][-1]
    prepare_linears(embed, backend)
    restore_linears(embed)
    conv = torch.randn(8, 3, 2, 2)
    embed.proj.weight.weight_loader(embed.proj.weight, conv)  # the conv-reshaping loader, not the plain one
    assert torch.equal(embed.proj.weight, conv.reshape(8, 12))


def test_cpu_platform_choice_and_reasons():
    cpu = CpuPlatform()
    assert cpu.linear_priority(torch.float32) == [L.ONEDNN, L.NATIVE]
    assert cpu.get_linear_backend(torch.float32) == RUNNABLE[torch.float32][-1] if len(RUNNABLE[torch.float32]) == 1 \
        else cpu.get_linear_backend(torch.float32) == L.ONEDNN
    assert cpu.get_linear_backend(torch.float32, batch_invariant=True) == L.NATIVE
    with pytest.raises(ValueError, match=r"linear backend ONEDNN cannot run dtype=float32 batch-invariantly on cpu: "
                                         r"not batch invariant: .*Usable here: NATIVE"):
        cpu.get_linear_backend(torch.float32, backend="onednn", batch_invariant=True)
    with pytest.raises(ValueError, match=r"no linear backend can run dtype=float32, quantization=fp8 on cpu: ONEDNN: "
                                         r"runs unquantized weights only"):
        cpu.get_linear_backend(torch.float32, quantization="fp8")
    with pytest.raises(ValueError, match=r"unknown linear backend 'mkl'; valid names: NATIVE, ONEDNN, FP8, ALIGNED"):
        cpu.get_linear_backend(torch.float32, backend="mkl")
    avx2 = CpuPlatform(DeviceInfo("cpu", "cpu", features=frozenset({"avx2"})))
    assert "bfloat16 needs AVX-512" in "; ".join(avx2.linear_backend_reasons(L.ONEDNN, torch.bfloat16))
    assert avx2.get_linear_backend(torch.bfloat16) == L.NATIVE and avx2.get_linear_backend(torch.float32) == L.ONEDNN
    arm = CpuPlatform(DeviceInfo("cpu", "cpu"))
    assert arm.get_linear_backend(torch.float32) == L.NATIVE
    assert "AVX2 or AVX-512" in "; ".join(arm.linear_backend_reasons(L.ONEDNN, torch.float32))


def test_cuda_platform_offers_aligned_native_and_fp8():
    h100 = CudaPlatform(DeviceInfo("cuda", "nvidia", (9, 0)))
    assert h100.get_linear_backend(torch.bfloat16) == L.ALIGNED
    assert h100.get_linear_backend(torch.bfloat16, batch_invariant=True) == L.NATIVE  # its token tiles
    assert h100.get_linear_backend(torch.bfloat16, backend="native") == L.NATIVE
    assert h100.linear_priority(torch.bfloat16, "fp8") == [L.FP8]
    assert any("unquantized weights only" in r for r in h100.linear_backend_reasons(L.ALIGNED, torch.bfloat16, "fp8"))
    reasons = h100.linear_backend_reasons(L.ONEDNN, torch.bfloat16)
    assert "not offered by the cuda platform" in reasons and any("needs a cpu device" in r for r in reasons)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_aligned_pads_the_input_width_and_matches_native(dtype):
    """ALIGNED (CUDA's default) zero-pads rows that are not 16-byte aligned, per call; the result is F.linear's."""
    cls = get_linear_backend_class(L.ALIGNED)
    torch.manual_seed(5)
    for rows, k, n, bias in [(9, 3420, 40, True), (4, 33, 7, False), (3, 1280, 24, True), (0, 5, 3, True)]:
        w, b = torch.randn(n, k).to(dtype), (torch.randn(n).to(dtype) if bias else None)
        x = torch.randn(rows, 2, k).to(dtype)
        state = cls.prepare(w, b)
        width = cls.padded_width(k, w.element_size())
        assert width * w.element_size() % 16 == 0 and 0 <= width - k < 16 // w.element_size()
        assert state.weight is w and cls.restore(state) is w  # the loaded tensor, the only copy
        want = F.linear(x, w, b)
        got = cls.apply(state, x)
        assert got.shape == want.shape and got.dtype == dtype
        if rows:
            assert _rel(got, want) < TOL[dtype], (k, _rel(got, want))
            assert _rel(cls.apply_unbiased(state, x), F.linear(x, w)) < TOL[dtype]
    assert cls.padded_width(3420, 2) == 3424 and cls.padded_width(3420, 4) == 3420


def test_aligned_layer_is_f_linear_under_compile():
    layer = ColumnParallelLinear(3421, 24)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(5, 3421)
    want = layer(x)
    assert prepare_linears(layer, L.ALIGNED) == 1
    assert _rel(layer(x), want) < 1e-5
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm
    assert _rel(torch.compile(layer, backend=backend)(x), want) < 1e-5
    targets = [getattr(node.target, "__name__", "") for g in graphs for node in g.graph.nodes]
    assert "linear" in targets and "pad" not in targets  # F.linear as NATIVE: Inductor aligns it itself
    assert restore_linears(layer).enum == L.ALIGNED and layer.linear_state is None


def test_probe_reads_cpu_features():
    assert HERE.type == "cpu" and HERE.features <= {"avx2", "avx512", "avx512_bf16", "amx", "amx_fp16"}
    assert DeviceInfo("cpu", "cpu", features=frozenset({"avx512_bf16"})).bf16_dot
    assert not DeviceInfo("cpu", "cpu", features=frozenset({"avx512"})).bf16_dot


def test_encoder_reports_and_overrides_the_linear_backend(q25):
    from mmenc.engine.encoder import Encoder

    grid = torch.tensor([[1, 4, 6]])
    px = torch.randn(24, 3 * 2 * 14 * 14)
    outs = {}
    for backend in RUNNABLE[torch.float32]:
        enc = Encoder(q25, device="cpu", linear_backend=backend.name.lower())
        assert enc.linear_backend() == backend.name
        outs[backend] = enc.encode_pixels(px, grid)
    for backend, out in outs.items():
        assert _rel(out, outs[L.NATIVE]) < 1e-5, backend
    invariant = Encoder(q25, device="cpu", batch_invariant=True)
    assert invariant.linear_backend() == "NATIVE"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_activation_matches_activation_after_the_matmul(dtype):
    torch.manual_seed(4)
    x = torch.randn(37, 48).to(dtype)
    for act in (torch.nn.GELU(approximate="tanh"), torch.nn.GELU(), torch.nn.SiLU()):
        for backend in RUNNABLE[dtype]:
            layer = ColumnParallelLinear(48, 70)
            layer.weight.data.normal_(0, 0.1)
            layer.bias.data.normal_()
            want = act(F.linear(x.float(), layer.weight.float(), layer.bias.float()))
            layer.to(dtype)
            prepare_linears(layer, backend)
            got = layer.forward_activated(x, act)
            if backend == L.NATIVE:
                assert torch.equal(got, act(layer(x))), "NATIVE: exactly act(linear(x))"
            err = _rel(got, want)
            assert err < TOL[dtype], f"{backend.name} {act}: relative error {err:.2e} >= {TOL[dtype]}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_aligned_matches_native_on_the_unaligned_down_projection():
    """Qwen2.5-VL's down projection (3420 inputs, bf16): ALIGNED's padded GEMM against F.linear, eager and compiled."""
    torch.manual_seed(6)
    dev = torch.device("cuda")
    w, b = 0.02 * torch.randn(1280, 3420, device=dev, dtype=torch.bfloat16), torch.randn(1280, device=dev,
                                                                                         dtype=torch.bfloat16)
    x = torch.randn(4096, 3420, device=dev, dtype=torch.bfloat16)
    want = F.linear(x.float(), w.float(), b.float())
    cls = get_linear_backend_class(L.ALIGNED)
    state = cls.prepare(w, b)
    assert _rel(cls.apply(state, x), want) < 1e-2
    assert _rel(torch.compile(lambda t: cls.apply(state, t))(x), want) < 1e-2
