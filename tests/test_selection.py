"""Backend selection on simulated devices of every built-in platform.

What is installed differs between machines (flash_attn, triton, xformers, aiter, torch_xla), so
these tests assert invariants of the choice, twice: with the packages as they are here, and with
every optional package pretended installed (which exercises the device and dtype checks alone).
"""
import logging

import pytest
import torch

from mmenc.attention.backend_enum import AttentionBackendEnum as B
from mmenc.attention.backends import get_backend_class, registered_backends
from mmenc.attention.layer import MMEncoderAttention
from mmenc.config import MultiModalConfig
from mmenc.platforms.cpu import CpuPlatform
from mmenc.platforms.cuda import CudaPlatform
from mmenc.platforms.device_info import DeviceInfo
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
    import mmenc.attention.backends as backends

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
