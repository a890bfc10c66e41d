"""transformers' reference for towers whose mmenc output includes the model's projector (PaddleOCR-VL,
ERNIE-4.5-VL, HunyuanOCR): the tower and projector modules of the full transformers model, called as
its `get_image_features` does, returning the embeddings the language model consumes [tokens, width].

Built from the checkpoint's config.json dict (no language model is built). With load_format="dummy"
transformers' random weights are shared with the mmenc tower; with a checkpoint folder the full
transformers model is loaded (`from_pretrained`, its weight renames applied) and its modules kept.
"""
import importlib
from collections.abc import Callable

import torch
import torch.nn as nn

# architecture -> (transformers module, model class, [(attribute, class, built from "vision"|"full" config)])
HF_PROJECTED: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    "PaddleOCRVLForConditionalGeneration": ("paddleocr_vl", "PaddleOCRVLForConditionalGeneration", [
        ("visual", "PaddleOCRVisionModel", "vision"), ("projector", "PaddleOCRProjector", "full")]),
    "Ernie4_5_VLMoeForConditionalGeneration": ("ernie4_5_vl_moe", "Ernie4_5_VLMoeForConditionalGeneration", [
        ("vision_tower", "Ernie4_5_VLMoeVisionTransformerPretrainedModel", "vision"),
        ("resampler_model", "Ernie4_5_VLMoeVariableResolutionResamplerModel", "full")]),
    "HunYuanVLForConditionalGeneration": ("hunyuan_vl", "HunYuanVLForConditionalGeneration", [
        ("vision_tower", "HunYuanVLVisionTransformer", "vision")]),
}


def _paddleocr(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    p = m.visual.config.patch_size
    pixel_values = pixel_values.reshape(1, pixel_values.shape[0], -1, p, p)  # get_image_features' layout
    return m.projector(m.visual(pixel_values=pixel_values, grid_thw=grid_thw).last_hidden_state, grid_thw)


def _ernie(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return m.resampler_model(m.vision_tower(pixel_values, grid_thw).last_hidden_state, grid_thw)


def _hunyuan(m: nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    return m.vision_tower(pixel_values, grid_thw=grid_thw).pooler_output[0]


_CALLS: dict[str, Callable] = {"paddleocr_vl": _paddleocr, "ernie4_5_vl_moe": _ernie, "hunyuan_vl": _hunyuan}


class ProjectedTower(nn.Module):
    """The transformers modules as attributes (their in-model names) and the call of get_image_features."""

    def __init__(self, modules: dict[str, nn.Module], call: Callable):
        super().__init__()
        for name, module in modules.items():
            setattr(self, name, module)
        self._call = call

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self._call(self, pixel_values, grid_thw)


def build_projected(loaded, attn_implementation: str = "sdpa") -> ProjectedTower:
    """transformers' tower + projector for `loaded` (a mmenc LoadedTower), same dtype, device and weights."""
    architecture = next(a for a in loaded.hf_config.get("architectures", []) if a in HF_PROJECTED)
    module, model_cls, parts = HF_PROJECTED[architecture]
    modeling = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    if loaded.load_format != "dummy":
        full = getattr(modeling, model_cls).from_pretrained(str(loaded.model), dtype=loaded.dtype,
                                                           attn_implementation=attn_implementation)
        modules = {name: getattr(full.model, name) for name, _, _ in parts}
        return ProjectedTower(modules, _CALLS[module]).to(loaded.device).eval()
    configuration = importlib.import_module(f"transformers.models.{module}.configuration_{module}")
    config_cls = next(getattr(configuration, n) for n in dir(configuration)
                      if n.endswith("Config") and getattr(getattr(configuration, n), "model_type", None) == module)
    config = config_cls(vision_config=dict(loaded.hf_config["vision_config"]),
                        text_config=dict(loaded.hf_config.get("text_config") or {}))
    config.vision_config._attn_implementation = attn_implementation
    modules = {}
    with torch.device(loaded.device):  # random init on the device
        for name, cls_name, which in parts:
            cls = getattr(modeling, cls_name)
            if which == "vision":
                modules[name] = cls._from_config(config.vision_config, attn_implementation=attn_implementation,
                                                 dtype=loaded.dtype)
            else:
                modules[name] = cls(config).to(loaded.dtype)
    tower = ProjectedTower(modules, _CALLS[module]).to(loaded.device).eval()
    prefixes = tuple(f"{name}." for name, _, _ in parts)
    with torch.no_grad():  # share transformers' random weights with the mmenc tower (names without the prefix)
        loaded.tower.load_weights((n.split(".", 1)[1] if n.startswith(prefixes) and len(parts) > 1 else
                                   n.removeprefix("vision_tower."), t)
                                  for n, t in tower.state_dict().items() if "inv_freq" not in n)
    return tower
