"""Vision towers, one file per family on the tower base (base.py); the registry finds the families."""
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower
from mmenc.models.registry import get_builtin_config, get_model_spec, register_model, supported_architectures

__all__ = ["ModelSpec", "TowerConfigBase", "TowerOutput", "VisionTower", "get_builtin_config", "get_model_spec",
           "register_model", "supported_architectures"]
