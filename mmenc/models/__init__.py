"""Vision towers, one file per family, registered by checkpoint architecture."""
from mmenc.models.base import ModelSpec, TowerOutput
from mmenc.models.registry import get_builtin_config, get_model_spec, register_model, supported_architectures

__all__ = ["ModelSpec", "TowerOutput", "get_builtin_config", "get_model_spec", "register_model",
           "supported_architectures"]
