"""Tower families by checkpoint architecture, and built-in configs by name.

The families register themselves: each module of the `mmenc.models` package that defines a family
calls `register_model(ModelSpec(...))` at import, and the first lookup imports every module of the
package. Adding a tower family is adding its file; nothing here names one.
"""
import importlib
import pathlib
import pkgutil

from collections.abc import Mapping
from typing import Any

from mmenc.models.base import ModelSpec, vision_model_type

_SPECS: dict[str, list[ModelSpec]] = {}  # architecture -> its families (by vision_config.model_type)
_discovered = False  # every module of the package imported


def register_model(spec: ModelSpec) -> ModelSpec:
    """Serve `spec.architectures` with this family. Families of one architecture are told apart by
    their vision_model_types; a later registration replaces an earlier one serving the same types.
    Its vision_architectures (vision-only checkpoints) are served alike."""
    for arch in (*spec.architectures, *spec.vision_architectures):
        kept = [s for s in _SPECS.get(arch, []) if s.vision_model_types and
                not set(s.vision_model_types) & set(spec.vision_model_types or s.vision_model_types)]
        _SPECS[arch] = [*kept, spec]
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


def model_specs(architecture: str) -> list[ModelSpec]:
    """Every family registered under `architecture` (one, or several told apart by vision_model_types)."""
    _discover_families()
    if architecture not in _SPECS:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    return list(_SPECS[architecture])


def get_model_spec(architecture: str, config: Mapping[str, Any] | None = None) -> ModelSpec:
    """The family serving `architecture`; where several do, the one for `config`'s vision_config.model_type
    (without a config: the first registered)."""
    specs = model_specs(architecture)
    if config is None or len(specs) == 1:
        return specs[0]
    vision_type = vision_model_type(config)
    found = [s for s in specs if s.vision_model_types and vision_type in s.vision_model_types]
    found = found or [s for s in specs if not s.vision_model_types]
    if not found:
        served = sorted(t for s in specs for t in s.vision_model_types)
        raise ValueError(f"vision_config.model_type={vision_type!r}; mmenc serves {architecture} with "
                         f"vision_config.model_type one of {served}")
    return found[0]


def builtin_model_names() -> list[str]:
    _discover_families()
    return sorted({name for specs in _SPECS.values() for spec in specs for name in spec.builtin_configs})


def get_builtin_config(name: str) -> tuple[ModelSpec, dict]:
    """(spec, config.json dict) for a built-in model name such as "Qwen/Qwen2.5-VL-7B-Instruct"."""
    _discover_families()
    for spec in (spec for specs in _SPECS.values() for spec in specs):
        if name in spec.builtin_configs:
            return spec, dict(spec.builtin_configs[name])
    raise ValueError(f"unknown built-in model {name!r}; built-in: {', '.join(builtin_model_names())}")
