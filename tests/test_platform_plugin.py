"""Out-of-tree platforms found through the `mmenc.platform_plugins` entry-point group.

Each test installs a tiny plugin distribution into tmp_path (a package plus a *.dist-info folder);
importlib.metadata finds distributions on sys.path, exactly as for a pip-installed plugin.
"""
import sys
import textwrap

import pytest
import torch

import mmenc.platforms as platforms
from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends import AttentionBackendEnum as B

PLATFORM_MODULE = '''
from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo
from mmenc.platforms import Platform


class {cls}(Platform):
    name = "{name}"
    device_type = "cpu"
    custom_op_key = "oot"

    def _detect_device_info(self):
        return DeviceInfo(type="cpu", vendor="{name}")

    def vit_attn_priority(self, dtype):
        return [B.NAIVE, B.TORCH_SDPA]


def present():
    return "{module}:{cls}"


def absent():
    return None


def broken():
    raise RuntimeError("{name} driver library not found")
'''


@pytest.fixture
def install_plugin(tmp_path, monkeypatch):
    """install_plugin(name, entry="present") writes distribution `name` with one platform plugin
    entry point (`present` returns the class path, `absent` returns None) into tmp_path."""
    monkeypatch.syspath_prepend(str(tmp_path))
    modules = []

    def install(name: str, entry: str = "present") -> str:
        module = f"mmenc_test_plugin_{name}"
        cls = f"{name.capitalize()}Platform"
        (tmp_path / module).mkdir()
        (tmp_path / module / "__init__.py").write_text(PLATFORM_MODULE.format(cls=cls, name=name, module=module))
        dist = tmp_path / f"{module}-0.1.dist-info"
        dist.mkdir()
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
            [{platforms.PLUGIN_GROUP}]
            {name} = {module}:{entry}
            """))
        modules.append(module)
        return f"{module}:{cls}"

    yield install
    for module in modules:
        sys.modules.pop(module, None)


def test_plugin_platform_is_resolved_and_its_priority_used(install_plugin, use_platform):
    install_plugin("acme")
    platform = platforms.resolve_platform()
    assert type(platform).__name__ == "AcmePlatform" and platform.name == "acme"
    # The built-in CPU platform would pick TORCH_SDPA; the plugin's list starts with NAIVE.
    assert platform.get_vit_attn_backend(80, torch.float32) is B.NAIVE
    assert platform.get_supported_vit_attn_backends() == [B.NAIVE, B.TORCH_SDPA]
    assert platform.get_vit_attn_backend(80, torch.float32, "torch_sdpa") is B.TORCH_SDPA


def test_current_platform_resolves_lazily_to_plugin(install_plugin, use_platform):
    install_plugin("acme")
    use_platform(None)
    assert platforms.current_platform.name == "acme"
    layer = MMEncoderAttention(2, 8)
    assert layer.backend is B.NAIVE
    assert layer._forward_method.__func__ is MMEncoderAttention.forward_oot
    q = torch.randn(1, 4, 16)
    assert layer(q, q, q).shape == q.shape


def test_plugin_returning_none_is_ignored(install_plugin):
    install_plugin("ghost", entry="absent")
    assert platforms.active_plugin_platforms() == {}
    assert type(platforms.resolve_platform()).__name__ == "CpuPlatform"


def test_absent_plugin_next_to_a_present_one(install_plugin):
    install_plugin("ghost", entry="absent")
    path = install_plugin("acme")
    assert platforms.active_plugin_platforms() == {"acme": path}
    assert platforms.resolve_platform().name == "acme"


def test_two_active_plugins_is_an_error_naming_both(install_plugin):
    first = install_plugin("acme")
    second = install_plugin("zeta")
    with pytest.raises(RuntimeError) as e:
        platforms.resolve_platform()
    msg = str(e.value)
    assert "acme" in msg and "zeta" in msg and first in msg and second in msg


def test_no_plugin_left_behind():
    assert platforms.active_plugin_platforms() == {}


def test_plugin_backend_in_a_top_level_module(tmp_path, monkeypatch):
    """A plugin registers its own backend from a top-level module ("acme_attn:Backend")."""
    import mmenc.backends.registry as backends

    (tmp_path / "mmenc_test_acme_attn.py").write_text(textwrap.dedent("""\
        from mmenc.backends import AttentionBackendEnum
        from mmenc.backends.naive import NaiveBackend

        class AcmeBackend(NaiveBackend):
            pass
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(backends._MODULES, B.PALLAS, "mmenc_test_acme_attn:AcmeBackend")
    try:
        assert backends.get_backend_class(B.PALLAS).__name__ == "AcmeBackend"
    finally:
        sys.modules.pop("mmenc_test_acme_attn", None)


def test_plugin_whose_entry_point_raises_is_skipped_with_a_warning(install_plugin, mmenc_caplog):
    install_plugin("broken", entry="broken")
    assert type(platforms.resolve_platform()).__name__ == "CpuPlatform"
    (record,) = [r for r in mmenc_caplog.records if r.levelname == "WARNING"]
    message = record.getMessage()
    assert "platform plugin broken" in message and "mmenc_test_plugin_broken:broken" in message
    assert "RuntimeError: broken driver library not found" in message


def test_broken_plugin_next_to_a_working_one(install_plugin, mmenc_caplog):
    install_plugin("broken", entry="broken")
    path = install_plugin("acme")
    assert platforms.active_plugin_platforms() == {"acme": path}
    assert platforms.resolve_platform().name == "acme"
    assert "platform plugin broken" in mmenc_caplog.text
