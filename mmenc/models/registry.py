"""Tower families by checkpoint architecture, and built-in configs by name.

Each family module calls `register_model(ModelSpec(...))` at import; `_FAMILIES` lists the modules
imported on first lookup, so adding a tower is one file plus one line here.
"""
import importlib

from mmenc.models.base import ModelSpec

_FAMILIES = [
    "qwen2_vl",
    "qwen2_5_vl",
    "qwen3_vl",
    "glm4v",
    "kimi_vit",
]
_SPECS: dict[str, ModelSpec] = {}
_loaded = False


def register_model(spec: ModelSpec) -> ModelSpec:
    for arch in spec.architectures:
        _SPECS[arch] = spec
    return spec


def _load_families() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        for module in _FAMILIES:
            importlib.import_module(f"mmenc.models.{module}")


def supported_architectures() -> list[str]:
    _load_families()
    return sorted(_SPECS)


def get_model_spec(architecture: str) -> ModelSpec:
    _load_families()
    if architecture not in _SPECS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _SPECS[architecture]


def builtin_model_names() -> list[str]:
    _load_families()
    return sorted({name for spec in _SPECS.values() for name in spec.builtin_configs})


def get_builtin_config(name: str) -> tuple[ModelSpec, dict]:
    """(spec, config.json dict) for a built-in model name such as "Qwen/Qwen2.5-VL-7B-Instruct"."""
    _load_families()
    for spec in _SPECS.values():
        if name in spec.builtin_configs:
            return spec, dict(spec.builtin_configs[name])
    raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(builtin_model_names())}")
