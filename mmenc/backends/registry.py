"""Backend registry: one module per backend (files of this package), looked up by `AttentionBackendEnum`."""
import importlib
import importlib.util

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend

_MODULES: dict[AttentionBackendEnum, str] = {
    AttentionBackendEnum.NAIVE: "naive:NaiveBackend",
    AttentionBackendEnum.TORCH_SDPA: "sdpa:TorchSDPABackend",
    AttentionBackendEnum.TORCH_VARLEN: "torch_varlen:TorchVarlenBackend",
    AttentionBackendEnum.FLEX_ATTENTION: "flex:FlexAttentionBackend",
    AttentionBackendEnum.FLASH_ATTN: "flash_attn:FlashAttnBackend",
    AttentionBackendEnum.TRITON_ATTN: "triton_attn:TritonAttnBackend",
    AttentionBackendEnum.XFORMERS: "xformers:XFormersBackend",
    AttentionBackendEnum.ROCM_AITER_FA: "rocm_aiter:AiterBackend",
    AttentionBackendEnum.PALLAS: "pallas:PallasBackend",
}


def registered_backends() -> list[AttentionBackendEnum]:
    return [b for b in AttentionBackendEnum if b in _MODULES]


def register_backend(backend: AttentionBackendEnum, target: str) -> None:
    """Register `target` ("module.path:Class", or a name relative to this package) for `backend`."""
    _MODULES[backend] = target


def get_backend_class(backend: AttentionBackendEnum) -> type[AttentionBackend]:
    target = _MODULES.get(backend)
    if target is None:
        raise ValueError(f"attention backend {backend.name} is not registered in this build of mmenc; "
                         f"registered: {', '.join(b.name for b in registered_backends())}")
    return load_target(target, __package__, f"attention backend {backend.name}")


def load_target(target: str, package: str, what: str):
    """The class "module:Class" names: a file of `package` when `module` has no dot and is one, else a
    top-level module (a plugin's); ModuleNotFoundError naming `what` when neither exists."""
    module, _, cls = target.partition(":")
    if "." not in module:
        local = f"{package}.{module}"
        if importlib.util.find_spec(local) is not None:
            module = local
        elif importlib.util.find_spec(module) is None:
            raise ModuleNotFoundError(f"{what} is registered as {target!r} but neither {local} nor {module} exists",
                                      name=local)
    return getattr(importlib.import_module(module), cls)
