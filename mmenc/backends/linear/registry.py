"""Linear backend registry: one module per backend (files of this package), looked up by LinearBackendEnum.
A backend another package provides registers itself with `register_linear_backend(enum, "module:Class")`."""
from mmenc.backends.linear.base import LinearBackend
from mmenc.backends.linear.enum import LinearBackendEnum
from mmenc.backends.registry import load_target

_MODULES: dict[LinearBackendEnum, str] = {
    LinearBackendEnum.NATIVE: "native:NativeLinear",
    LinearBackendEnum.ONEDNN: "onednn:OneDNNLinear",
    LinearBackendEnum.FP8: "fp8:Fp8Linear",
    LinearBackendEnum.ALIGNED: "aligned:AlignedLinear",
}


def registered_linear_backends() -> list[LinearBackendEnum]:
    return [b for b in LinearBackendEnum if b in _MODULES]


def register_linear_backend(backend: LinearBackendEnum, target: str) -> None:
    """Register `target` ("module.path:Class", or a file name of this package) for `backend`."""
    _MODULES[backend] = target


def get_linear_backend_class(backend: LinearBackendEnum) -> type[LinearBackend]:
    target = _MODULES.get(backend)
    if target is None:
        raise ValueError(f"linear backend {backend.name} is not registered in this build of mmenc; "
                         f"registered: {', '.join(b.name for b in registered_linear_backends())}")
    return load_target(target, __package__, f"linear backend {backend.name}")
