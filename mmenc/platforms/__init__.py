"""The current platform, resolved once on first use.

Order: an out-of-tree platform from the entry-point group `mmenc.platform_plugins` (each entry is a
function returning a platform class path "module:Class" or None when its device is absent; two
active plugins is an error; one whose entry point raises is logged and skipped), else the
built-in platform for the hardware torch sees. `platform_for(device)` is the platform of the
device a layer runs on: the current one, or the built-in CPU platform for CPU tensors elsewhere.
"""
import functools
import importlib
import importlib.metadata
import importlib.util

import torch

from mmenc.backends import DeviceInfo
from mmenc.logger import init_logger
from mmenc.platforms.interface import BackendReport, Platform

logger = init_logger(__name__)

PLUGIN_GROUP = "mmenc.platform_plugins"

BUILTIN_PLATFORMS = {
    "cuda": "mmenc.platforms.cuda:CudaPlatform",
    "rocm": "mmenc.platforms.rocm:RocmPlatform",
    "cpu": "mmenc.platforms.cpu:CpuPlatform",
    "xpu": "mmenc.platforms.xpu:XpuPlatform",
    "tpu": "mmenc.platforms.tpu:TpuPlatform",
}

_current: Platform | None = None


def load_class(path: str) -> type:
    module, _, name = path.partition(":")
    if not name:
        module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def active_plugin_platforms() -> dict[str, str]:
    """{plugin name: platform class path} for every installed plugin whose device is present."""
    active = {}
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        try:
            path = entry.load()()
        except Exception as e:  # a broken plugin must not stop mmenc: say which, go on without it
            logger.warning("platform plugin %s (%s) failed and is skipped: %s: %s", entry.name, entry.value,
                           type(e).__name__, e)
            continue
        if path is not None:
            active[entry.name] = path
    return active


def detect_builtin() -> str:
    if torch.cuda.is_available():
        return "rocm" if torch.version.hip else "cuda"
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return "xpu"
    if importlib.util.find_spec("torch_xla") is not None:
        return "tpu"
    return "cpu"


def resolve_platform() -> Platform:
    plugins = active_plugin_platforms()
    if len(plugins) > 1:
        names = ", ".join(f"{n} ({p})" for n, p in sorted(plugins.items()))
        raise RuntimeError(f"more than one out-of-tree platform plugin is active: {names}; "
                           f"uninstall all but one")
    if plugins:
        name, path = next(iter(plugins.items()))
        logger.info("platform: out-of-tree plugin %s (%s)", name, path)
        return load_class(path)()
    return load_class(BUILTIN_PLATFORMS[detect_builtin()])()


def set_current_platform(platform: Platform | None) -> None:
    """Replace the current platform (None: resolve again on next use). For tests and embedders."""
    global _current
    _current = platform


def platform_for(device: torch.device | str | None) -> Platform:
    """The platform that runs tensors on `device`: the current platform when it is of that device
    type (or `device` is None or "meta"), the built-in CPU platform for "cpu" on any machine."""
    current = _resolved()
    kind = torch.device(device).type if device is not None else current.device_type
    if kind in (current.device_type, "meta"):
        return current
    if kind == "cpu":
        return _builtin("cpu")
    raise ValueError(f"device {str(device)!r} is not run by the current platform {current.name!r} "
                     f"(device type {current.device_type!r}); use a {current.device_type} or cpu device")


@functools.cache
def _builtin(name: str) -> Platform:
    """One instance per built-in platform asked for by name (the CPU one for CPU tensors on a GPU host)."""
    return load_class(BUILTIN_PLATFORMS[name])()


def _resolved() -> Platform:
    global _current
    if _current is None:
        _current = resolve_platform()
    return _current


def __getattr__(name: str):
    if name == "current_platform":
        return _resolved()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BackendReport", "DeviceInfo", "Platform", "current_platform", "platform_for", "resolve_platform",
           "set_current_platform", "BUILTIN_PLATFORMS"]
