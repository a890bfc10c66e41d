"""Tower families by checkpoint architecture, and built-in configs by name.

The families register themselves: each module of the `mmenc.models` package that defines a family
calls `register_model(ModelSpec(...))` at import, and the first lookup imports every module of the
package. Adding a tower family is adding its file; nothing here names one.
"""
import importlib
import pathlib
import pkgutil

from mmenc.models.base import ModelSpec

_SPECS: dict[str, ModelSpec] = {}
_discovered = False  # every module of the package imported


def register_model(spec: ModelSpec) -> ModelSpec:
    """Serve `spec.architectures` with this family (a later registration of a name replaces the earlier)."""
    for arch in spec.architectures:
        _SPECS[arch] = spec
    return spec


def _discover_families() -> None:
    global _discovered
    if _discovered:
        return
    package = __name__.rpartition(".")[0]  # mmenc.models: this file's folder
    for module in pkgutil.iter_modules([str(pathlib.Path(__file__).parent)]):
        if not module.name.startswith("_"):
            importlib.import_module(f"{package}.{module.name}")
    _discovered = True  # only once all imported: a family that fails to import fails every lookup, loudly


def supported_architectures() -> list[str]:
    _discover_families()
    return sorted(_SPECS)


def get_model_spec(architecture: str) -> ModelSpec:
    _discover_families()
    if architecture not in _SPECS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _SPECS[architecture]


def builtin_model_names() -> list[str]:
    _discover_families()
    return sorted({name for spec in _SPECS.values() for name in spec.builtin_configs})


def get_builtin_config(name: str) -> tuple[ModelSpec, dict]:
    """(spec, config.json dict) for a built-in model name such as "Qwen/Qwen2.5-VL-7B-Instruct"."""
    _discover_families()
    for spec in _SPECS.values():
        if name in spec.builtin_configs:
            return spec, dict(spec.builtin_configs[name])
    raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(builtin_model_names())}")
