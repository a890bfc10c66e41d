"""Backend selection on simulated devices of every built-in platform.

What is installed differs between machines (flash_attn, triton, xformers, aiter, torch_xla), so
these tests assert invariants of the choice, twice: with the packages as they are here, and with
every optional package pretended installed (which exercises the device and dtype checks alone).
"""
import logging

import pytest
import torch

from mmenc.attention import MMEncoderAttention, make_cu_seqlens
from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import BackendChoice, DeviceInfo, get_backend_class, registered_backends
from mmenc.config import MultiModalConfig
from mmenc.platforms.cpu import CpuPlatform
from mmenc.platforms.cuda import CudaPlatform
from mmenc.platforms.rocm import RocmPlatform
from mmenc.platforms.tpu import TpuPlatform
from mmenc.platforms.xpu import XpuPlatform

PLATFORMS = {
    "cuda-7.5": lambda: CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(7, 5))),
    "cuda-8.0": lambda: CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(8, 0))),
    "cuda-9.0": lambda: CudaPlatform(DeviceInfo(type="cuda", vendor="nvidia", capability=(9, 0))),
    "rocm-gfx90a": lambda: RocmPlatform(DeviceInfo(type="cuda", vendor="amd", arch="gfx90a")),
    "rocm-gfx1100": lambda: RocmPlatform(DeviceInfo(type="cuda", vendor="amd", arch="gfx1100")),
    "cpu": lambda: CpuPlatform(DeviceInfo(type="cpu", vendor="cpu")),
    "xpu": lambda: XpuPlatform(DeviceInfo(type="xpu", vendor="intel")),
    "tpu": lambda: TpuPlatform(DeviceInfo(type="xla", vendor="google")),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEAD_SIZES = [17, 72, 80, 128]
# Kernels that only exist for half precision, whatever else is true.
HALF_ONLY = {B.FLASH_ATTN, B.ROCM_AITER_FA}


@pytest.fixture(params=["as-installed", "all-installed"])
def installed(request, monkeypatch):
    if request.param == "all-installed":
        for backend in registered_backends():
            monkeypatch.setattr(get_backend_class(backend), "is_installed", classmethod(lambda cls: True))
    return request.param


def _first_usable(platform, head_size, dtype):
    for backend in platform.vit_attn_priority(dtype):
        if not platform.backend_reasons(backend, head_size, dtype):
            return backend
    return None


@pytest.mark.parametrize("name", PLATFORMS)
def test_choice_invariants(name, installed):
    platform = PLATFORMS[name]()
    for dtype in DTYPES:
        for head_size in HEAD_SIZES:
            where = f"{name} {installed} head_size={head_size} {dtype}"
            reports = {r.backend: r for r in platform.explain_vit_attn_backends(head_size, dtype)}
            assert list(reports) == registered_backends(), where
            expected = _first_usable(platform, head_size, dtype)
            if expected is None:
                with pytest.raises(ValueError) as e:
                    platform.get_vit_attn_backend(head_size, dtype)
                for backend in platform.vit_attn_priority(dtype):
                    assert backend.name in str(e.value), where
                continue
            chosen = platform.get_vit_attn_backend(head_size, dtype)
            assert chosen is expected, where
            assert platform.backend_reasons(chosen, head_size, dtype) == [], where
            assert reports[chosen].usable and reports[chosen].in_priority, where
            assert chosen in platform.get_supported_vit_attn_backends(), where
            if name == "cuda-7.5":
                assert chosen not in (B.TRITON_ATTN, B.FLASH_ATTN), where
            if dtype == torch.float32:
                assert chosen not in HALF_ONLY, where
            short = platform.get_vit_attn_short_backend(head_size, dtype, chosen)
            if short is not None:  # the per-shape choice obeys the same rules
                assert short is not chosen and short in platform.vit_attn_short_priority(dtype), where
                assert platform.backend_reasons(short, head_size, dtype) == [], where
                if name == "cuda-7.5":
                    assert short not in (B.TRITON_ATTN, B.FLASH_ATTN), where
                if dtype == torch.float32:
                    assert short not in HALF_ONLY, where
            # Every report's reasons agree with backend_reasons, and usable means no reasons.
            for backend, report in reports.items():
                assert list(report.reasons) == platform.backend_reasons(backend, head_size, dtype), where
                assert report.usable == (not report.reasons), where
                assert report.in_priority == (backend in platform.get_supported_vit_attn_backends()), where


@pytest.mark.parametrize("name", PLATFORMS)
def test_half_only_backends_say_so_for_float32(name, installed):
    platform = PLATFORMS[name]()
    for report in platform.explain_vit_attn_backends(80, torch.float32):
        if report.backend in HALF_ONLY:
            assert any("float32" in r for r in report.reasons), (name, report)


@pytest.mark.parametrize("name", PLATFORMS)
def test_backends_not_offered_are_never_usable(name, installed):
    platform = PLATFORMS[name]()
    offered = platform.get_supported_vit_attn_backends()
    for report in platform.explain_vit_attn_backends(80, torch.bfloat16):
        if report.backend not in offered:
            assert not report.usable
            assert f"not offered by the {platform.name} platform" in report.reasons


def test_pre_ampere_does_not_offer_flash_or_triton(installed):
    platform = PLATFORMS["cuda-7.5"]()
    for backend in (B.FLASH_ATTN, B.TRITON_ATTN):
        for dtype in DTYPES:
            assert platform.backend_reasons(backend, 128, dtype), backend


def test_aiter_needs_gfx9(installed):
    assert PLATFORMS["rocm-gfx1100"]().backend_reasons(B.ROCM_AITER_FA, 128, torch.bfloat16)


@pytest.mark.parametrize("name", PLATFORMS)
def test_explicit_backend_used_or_rejected_never_replaced(name, installed):
    platform = PLATFORMS[name]()
    for dtype in DTYPES:
        for head_size in (72, 128):
            usable = [b for b in platform.vit_attn_priority(dtype)
                      if not platform.backend_reasons(b, head_size, dtype)]
            for backend in registered_backends():
                reasons = platform.backend_reasons(backend, head_size, dtype)
                if not reasons:
                    assert platform.get_vit_attn_backend(head_size, dtype, backend) is backend
                    assert platform.get_vit_attn_backend(head_size, dtype, backend.name.lower()) is backend
                    continue
                with pytest.raises(ValueError) as e:
                    platform.get_vit_attn_backend(head_size, dtype, backend)
                msg = str(e.value)
                assert backend.name in msg and f"head_size={head_size}" in msg
                for reason in reasons:
                    assert reason in msg, (msg, reason)
                for alternative in usable:
                    assert alternative.name in msg, (msg, alternative)
                if not usable:
                    assert "none" in msg


def test_fixed_expectations():
    cpu = PLATFORMS["cpu"]()
    assert cpu.get_vit_attn_backend(80, torch.float32) is B.TORCH_SDPA
    assert cpu.get_vit_attn_backend(17, torch.bfloat16) is B.TORCH_SDPA
    # Pre-Ampere: SDPA leads the list and needs nothing.
    assert PLATFORMS["cuda-7.5"]().get_vit_attn_backend(80, torch.float16) is B.TORCH_SDPA
    # FlashAttention cannot run float32, so Hopper falls through to SDPA.
    assert PLATFORMS["cuda-9.0"]().get_vit_attn_backend(80, torch.float32) is B.TORCH_SDPA
    # The reference runs anywhere.
    for make in PLATFORMS.values():
        assert make().get_vit_attn_backend(17, torch.float32, "naive") is B.NAIVE


def test_explicit_flash_on_cpu_names_reason_and_alternative():
    with pytest.raises(ValueError) as e:
        PLATFORMS["cpu"]().get_vit_attn_backend(80, torch.float32, "flash_attn")
    msg = str(e.value)
    assert "FLASH_ATTN" in msg and "not offered by the cpu platform" in msg and "TORCH_SDPA" in msg


def test_unknown_explicit_backend():
    with pytest.raises(ValueError, match=r"unknown attention backend 'fast'.*TORCH_SDPA"):
        PLATFORMS["cpu"]().get_vit_attn_backend(80, torch.float32, "fast")


def test_layer_uses_config_backend_and_rejects_unusable(use_platform):
    use_platform(PLATFORMS["cpu"]())
    layer = MMEncoderAttention(2, 8, multimodal_config=MultiModalConfig(mm_encoder_attn_backend="NAIVE"))
    assert layer.backend is B.NAIVE
    assert MMEncoderAttention(2, 8).backend is B.TORCH_SDPA
    with pytest.raises(ValueError, match="FLASH_ATTN"):
        MMEncoderAttention(2, 8, multimodal_config=MultiModalConfig(mm_encoder_attn_backend=B.FLASH_ATTN))


def _choice_records(caplog):
    return [r for r in caplog.records if r.name.startswith("mmenc") and "encoder attention:" in r.getMessage()]


def test_choice_logged_once_with_reason(mmenc_caplog):
    platform = PLATFORMS["cpu"]()
    for _ in range(3):
        platform.get_vit_attn_backend(24, torch.float32)
    records = _choice_records(mmenc_caplog)
    assert len(records) == 1
    assert records[0].levelno == logging.INFO
    message = records[0].getMessage()
    assert "TORCH_SDPA" in message and "head_size=24" in message and "priority" in message


def test_explicit_choice_logged_once(mmenc_caplog):
    platform = PLATFORMS["cpu"]()
    for _ in range(3):
        platform.get_vit_attn_backend(24, torch.float32, B.NAIVE)
    records = _choice_records(mmenc_caplog)
    assert len(records) == 1 and "NAIVE (requested)" in records[0].getMessage()


def test_fallback_reason_is_logged(mmenc_caplog):
    PLATFORMS["cuda-9.0"]().get_vit_attn_backend(80, torch.float32)
    (record,) = _choice_records(mmenc_caplog)
    # The log says why the platform's first choice was passed over.
    assert "FLASH_ATTN" in record.getMessage() and "float32" in record.getMessage()


def test_unregistered_backend_in_a_priority_list_is_a_reason_not_a_crash(monkeypatch):
    import mmenc.backends.registry as backends

    monkeypatch.delitem(backends._MODULES, B.TRITON_ATTN, raising=False)
    platform = PLATFORMS["cuda-9.0"]()
    assert platform.backend_reasons(B.TRITON_ATTN, 80, torch.bfloat16) == ["not registered in this build of mmenc"]
    # Rejecting another request still explains that request (the usable list skips TRITON_ATTN).
    with pytest.raises(ValueError) as e:
        platform.get_vit_attn_backend(80, torch.float32, B.FLASH_ATTN)
    assert "FLASH_ATTN" in str(e.value) and "TRITON_ATTN" not in str(e.value).split("Usable here:")[1]


def test_short_segment_backend(use_platform, fake_platform_cls):
    cls = fake_platform_cls("cpu", priority=(B.TORCH_SDPA, B.NAIVE), name="windows")
    cls.vit_attn_short_priority = lambda self, dtype: [B.FLASH_ATTN, B.NAIVE]
    platform = cls()
    # FLASH_ATTN cannot run here, so the first usable short-segment backend is NAIVE.
    assert platform.get_vit_attn_short_backend(80, torch.float32, B.TORCH_SDPA) is B.NAIVE
    assert platform.get_vit_attn_short_backend(80, torch.float32, B.NAIVE) is None  # same as the main one
    use_platform(platform)
    layer = MMEncoderAttention(2, 8)
    assert (layer.backend, layer.short_backend) == (B.TORCH_SDPA, B.NAIVE)
    # An explicit backend runs every pack.
    explicit = MMEncoderAttention(2, 8, multimodal_config=MultiModalConfig(mm_encoder_attn_backend="torch_sdpa"))
    assert explicit.short_backend is None


# The device the tensors are on decides: a CPU layer on a CUDA machine runs the CPU platform's choice.

@pytest.fixture
def simulated_cuda(use_platform, monkeypatch):
    """An H100-like CUDA platform as the current one, with triton counted as installed, so bf16
    layers choose TORCH_SDPA (FlashAttention is absent) plus TRITON_ATTN for short segments."""
    monkeypatch.setattr(get_backend_class(B.TRITON_ATTN), "is_installed", classmethod(lambda cls: True))
    return use_platform(PLATFORMS["cuda-9.0"]())


@pytest.fixture
def ran(monkeypatch):
    """The backends the dispatcher ran, in order."""
    import mmenc.backends.dispatch as dispatch

    seen, real = [], dispatch.get_backend_class

    def spy(backend):
        seen.append(backend)
        return real(backend)
    monkeypatch.setattr(dispatch, "get_backend_class", spy)
    return seen


def _windows(dtype=torch.bfloat16):
    """A pack of two 32-token windows (short segments), 2 heads of 8."""
    q, k, v = (torch.randn(1, 64, 16, dtype=dtype) for _ in range(3))
    cu, max_seqlen = make_cu_seqlens([32, 32])
    return q, k, v, cu, max_seqlen


def test_layer_built_for_cpu_on_a_cuda_machine_uses_the_cpu_choice(simulated_cuda, ran):
    gpu_layer = MMEncoderAttention(2, 8, dtype=torch.bfloat16)
    assert gpu_layer.choice == BackendChoice(B.TORCH_SDPA, B.TRITON_ATTN)  # what the GPU would run
    layer = MMEncoderAttention(2, 8, dtype=torch.bfloat16, device="cpu")
    assert layer.choice == BackendChoice(B.TORCH_SDPA) and layer.describe_backend() == "TORCH_SDPA"
    q, k, v, cu, max_seqlen = _windows()
    out = layer(q, k, v, cu, max_seqlen)
    assert ran == [B.TORCH_SDPA]
    want = get_backend_class(B.NAIVE).forward(q[0].view(64, 2, 8), k[0].view(64, 2, 8), v[0].view(64, 2, 8),
                                              cu, max_seqlen, 8 ** -0.5)
    torch.testing.assert_close(out.view(64, 2, 8), want, atol=2e-2, rtol=2e-2)


def test_cpu_tensors_in_a_layer_built_for_cuda_get_the_cpu_choice_once(simulated_cuda, ran, monkeypatch):
    """The tower was built for the GPU platform, then run on CPU tensors (moved with .to("cpu")):
    before, TRITON_ATTN ran on CPU tensors and failed inside Triton."""
    layer = MMEncoderAttention(2, 8, dtype=torch.bfloat16)
    q, k, v, cu, max_seqlen = _windows()
    first = layer(q, k, v, cu, max_seqlen)
    choose = []
    monkeypatch.setattr(CpuPlatform, "choose_vit_attn", lambda *a, **kw: choose.append(a))
    second = layer(q, k, v, cu, max_seqlen)  # the choice for "cpu" is remembered: no second selection
    assert ran == [B.TORCH_SDPA, B.TORCH_SDPA] and choose == [] and torch.equal(first, second)
    assert layer.choice == BackendChoice(B.TORCH_SDPA, B.TRITON_ATTN)  # the GPU choice is kept for GPU tensors


def test_custom_op_forward_follows_the_tensors_device(simulated_cuda):
    class Probe(MMEncoderAttention):
        def forward_cuda(self, query, key, value, cu_seqlens=None, max_seqlen=None):
            return "forward_cuda"

        def forward_cpu(self, query, key, value, cu_seqlens=None, max_seqlen=None):
            return "forward_cpu"

    q = torch.randn(1, 4, 16)
    assert Probe(2, 8)(q, q, q) == "forward_cpu"  # built for cuda, called with CPU tensors
    assert Probe(2, 8, device="cpu")._forward_method.__name__ == "forward_cpu"
    assert Probe(2, 8)._forward_method.__name__ == "forward_cuda"
    disabled = MultiModalConfig(custom_ops=("none",))
    assert Probe(2, 8, multimodal_config=disabled)(q, q, q).shape == q.shape  # forward_native on any device


def test_explicit_backend_that_cannot_run_on_the_tensors_device(simulated_cuda):
    config = MultiModalConfig(mm_encoder_attn_backend="triton_attn")
    layer = MMEncoderAttention(2, 8, dtype=torch.bfloat16, multimodal_config=config, prefix="blocks.0.attn")
    assert layer.choice == BackendChoice(B.TRITON_ATTN)  # fine for the GPU
    with pytest.raises(ValueError) as e:
        layer(*_windows())
    msg = str(e.value)
    assert msg.startswith("blocks.0.attn: built for cuda, called with tensors on cpu: attention backend TRITON_ATTN")
    assert "not offered by the cpu platform" in msg and "Usable here: TORCH_SDPA, NAIVE" in msg
    with pytest.raises(ValueError, match=r"TRITON_ATTN cannot run .* on cpu: .*Usable here: TORCH_SDPA, NAIVE"):
        MMEncoderAttention(2, 8, dtype=torch.bfloat16, multimodal_config=config, device="cpu")


def test_platform_for(simulated_cuda, use_platform):
    from mmenc.platforms import platform_for

    assert platform_for(None) is simulated_cuda and platform_for("cuda:1") is simulated_cuda
    assert platform_for(torch.device("meta")) is simulated_cuda  # shapes only: built for the platform's device
    cpu = platform_for("cpu")
    assert type(cpu) is CpuPlatform and platform_for(torch.device("cpu")) is cpu
    with pytest.raises(ValueError, match=r"device 'xpu' is not run by the current platform 'cuda'"):
        platform_for("xpu")
    here = use_platform(PLATFORMS["cpu"]())
    assert platform_for("cpu") is here


def test_encoder_on_cpu_on_a_cuda_machine(simulated_cuda, ran, tmp_path):
    """Encoder(device="cpu") with the CUDA platform current: the tower's attention runs the CPU
    platform's backend on its CPU tensors (window layers included)."""
    from mmenc.testing.checkpoints import random_pixels, save_qwen2_5_vl
    from mmenc.engine.encoder import Encoder

    folder = save_qwen2_5_vl(tmp_path)[0]
    grid = torch.tensor([[1, 8, 8]])
    reference = Encoder(str(folder), device="cpu", dtype="bfloat16")
    out = reference.encode_pixels(random_pixels(grid).to(torch.bfloat16), grid)
    assert out.device.type == "cpu" and torch.isfinite(out.float()).all()
    assert set(ran) == {B.TORCH_SDPA}


def test_backend_choice_applies_the_short_rule_in_one_place():
    choice = BackendChoice(B.FLASH_ATTN, B.TRITON_ATTN, 256)
    assert [choice.backend_for(n) for n in (1, 256, 257)] == [B.TRITON_ATTN, B.TRITON_ATTN, B.FLASH_ATTN]
    assert choice.describe() == "FLASH_ATTN (TRITON_ATTN for segments <= 256)"
    assert BackendChoice(B.NAIVE, B.NAIVE).short is None  # the same backend twice is no per-shape choice
    assert BackendChoice(B.NAIVE).backend_for(1) is B.NAIVE
    with pytest.raises(ValueError, match="short_seqlen_max=-1"):
        BackendChoice(B.NAIVE, B.TORCH_SDPA, -1)
    assert PLATFORMS["cpu"]().choose_vit_attn(80, torch.float32) == BackendChoice(B.TORCH_SDPA)
