"""Shared fixtures (and HF_HUB_OFFLINE=1 for the whole suite): platform replacement that is always undone, log capture for mmenc's logger, and
the serve and Ray tests' tiny Qwen2.5-VL checkpoint with its CPU Encoder (one of each per module)."""
import logging
import os

import pytest

# No test reaches the Hugging Face Hub: a Hub id resolves from a cache the test lays out on disk
# (mmenc.testing.hub_cache). Set before huggingface_hub is imported; subprocesses inherit it.
os.environ["HF_HUB_OFFLINE"] = "1"

import mmenc.platforms as platforms
from mmenc.logger import log_once
from mmenc.platforms import Platform


@pytest.fixture(autouse=True)
def _restore_platform():
    """Whatever a test does with `set_current_platform`, the next test sees the platform from before."""
    before = platforms._current
    yield
    platforms.set_current_platform(before)


@pytest.fixture(autouse=True)
def _keep_log_level():
    """CLI runs set the `mmenc` logger's level (--quiet, --log-level); the next test sees the level from before."""
    logger = logging.getLogger("mmenc")
    level = logger.level
    yield
    logger.setLevel(level)


@pytest.fixture
def use_platform():
    """use_platform(platform) makes `platform` the current one for this test; returns it."""
    def use(platform: Platform) -> Platform:
        platforms.set_current_platform(platform)
        return platform
    return use


@pytest.fixture
def fake_platform_cls():
    """fake_platform_cls(custom_op_key, priority=(...)) -> a Platform subclass for a simulated CPU-like device."""
    from mmenc.backends import AttentionBackendEnum as B
    from mmenc.backends import DeviceInfo

    def make(custom_op_key: str = "native", priority=(B.TORCH_SDPA, B.NAIVE), name: str = "fake"):
        class FakePlatform(Platform):
            device_type = "cpu"

            def _detect_device_info(self):
                return DeviceInfo(type="cpu", vendor=name)

            def vit_attn_priority(self, dtype):
                return list(priority)

        FakePlatform.name = name
        FakePlatform.custom_op_key = custom_op_key
        return FakePlatform
    return make


@pytest.fixture
def mmenc_caplog(caplog, monkeypatch):
    """caplog that sees mmenc's records (its logger does not propagate) with log_once's memory emptied."""
    monkeypatch.setattr(logging.getLogger("mmenc"), "propagate", True)
    seen = log_once.__defaults__[0]
    saved = set(seen)
    seen.clear()
    caplog.set_level(logging.INFO, logger="mmenc")
    yield caplog
    seen.update(saved)


@pytest.fixture(scope="module")
def q25(tmp_path_factory):
    """A tiny random-weight Qwen2.5-VL checkpoint folder (mmenc.testing.checkpoints), one per test module."""
    from mmenc.testing.checkpoints import save_qwen2_5_vl

    return str(save_qwen2_5_vl(tmp_path_factory.mktemp("q25"))[0])


@pytest.fixture(scope="module")
def folder(q25):
    """`q25` by the name the CLI, encoder and end-to-end test modules use."""
    return q25


@pytest.fixture(scope="module")
def reference(q25):
    """Encoder.encode on the CPU over `q25`: what served answers are compared with."""
    from mmenc.engine.encoder import Encoder

    return Encoder(q25, device="cpu")
