"""Qwen2-VL vision tower: patch embedding, 2-D rotary, LayerNorm + QuickGELU blocks, 2x2 patch merger.

Every token attends to the other patches of its own frame (an image is one frame; a video of t
temporal patches is t frames). Tokens stay in merge-block order throughout, so the merger's 2x2
blocks are contiguous.

Tensor parallelism: `tp_size=None` shards heads and MLP features over the current tensor-parallel
group; `tp_size=1` builds the tower unsharded (data-parallel mode).
"""
import dataclasses
import importlib
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.config import MultiModalConfig
from mmenc.layers.grid import LRUCache, frame_lengths, merged_tokens, num_patches, read_grid
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock, resolve_tp_size
from mmenc.layers.weights import WeightMap, load_named_weights
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput
from mmenc.models.registry import register_model


def vision_config_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `vision_config` of a full config.json dict (or the dict itself if it is a vision config)."""
    vision = config.get("vision_config", config)
    if not isinstance(vision, Mapping):
        raise ValueError(f"config.json 'vision_config' is {type(vision).__name__}; expected a mapping")
    return dict(vision)


def rope_theta(vision: Mapping[str, Any], default: float = 10000.0) -> float:
    rope = vision.get("rope_parameters") or {}
    return float(rope.get("rope_theta", vision.get("rope_theta", default)))


@dataclasses.dataclass(frozen=True)
class Qwen2VisionConfig(TowerConfigBase):
    """Qwen2-VL's vision_config. Defaults are transformers' Qwen2VLVisionConfig defaults.

    embed_dim: the tower's width; hidden_size: the output width (the language model's hidden size).
    """

    width_field: ClassVar[str] = "embed_dim"
    depth: int = 32
    embed_dim: int = 1280
    hidden_size: int = 3584
    num_heads: int = 16
    mlp_ratio: float = 4.0
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_positive("depth", "embed_dim", "hidden_size", "num_heads", "in_channels", "patch_size",
                            "temporal_patch_size", "spatial_merge_size")
        self.check_rotary_heads()

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "Qwen2VisionConfig":
        v = vision_config_dict(config)
        d = cls()
        return cls(depth=v.get("depth", d.depth), embed_dim=v.get("embed_dim", d.embed_dim),
                   hidden_size=v.get("hidden_size", d.hidden_size), num_heads=v.get("num_heads", d.num_heads),
                   mlp_ratio=v.get("mlp_ratio", d.mlp_ratio), hidden_act=v.get("hidden_act", d.hidden_act),
                   in_channels=v.get("in_channels", v.get("in_chans", d.in_channels)),
                   patch_size=v.get("patch_size", v.get("spatial_patch_size", d.patch_size)),
                   temporal_patch_size=v.get("temporal_patch_size", d.temporal_patch_size),
                   spatial_merge_size=v.get("spatial_merge_size", d.spatial_merge_size),
                   rope_theta=rope_theta(v))


# Checkpoint name -> parameter name (the merger's nn.Sequential indices become fc1 / fc2).
QWEN2_VL_WEIGHT_MAP = WeightMap([
    ("merger.mlp.0.", "merger.fc1.", None),
    ("merger.mlp.2.", "merger.fc2.", None),
])


@dataclasses.dataclass
class PackPlan:
    """What a forward derives from grid_thw, once: attention segments and rotary tables (device),
    and for window attention the token permutation and its inverse."""

    num_patches: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    cos: torch.Tensor
    sin: torch.Tensor
    cu_window_seqlens: torch.Tensor | None = None
    max_window_seqlen: int = 0
    token_order: torch.Tensor | None = None  # int64 [T]: patch i of the pack is original patch token_order[i]
    merged_inverse: torch.Tensor | None = None  # int64 [T / m^2]: restores image order after the merger


def check_patch_count(pixel_values: torch.Tensor, plan: PackPlan) -> None:
    if pixel_values.shape[0] != plan.num_patches:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw describes {plan.num_patches} "
                         f"patches (sum of t*h*w); pass the grid_thw that came with these pixel_values")


class Qwen2VisionTower(nn.Module):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, hidden_size], images in grid order."""

    weight_map = QWEN2_VL_WEIGHT_MAP

    def __init__(self, config: Qwen2VisionConfig, multimodal_config: MultiModalConfig | None = None,
                 device=None, dtype=None, tp_size: int | None = None):
        super().__init__()
        self.config = config
        tp = resolve_tp_size(tp_size)
        self.tp_size = tp
        self.merge = config.spatial_merge_size
        self.patch_embed = PatchEmbed(config.patch_features, config.embed_dim, bias=False, device=device, dtype=dtype)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge)
        self.blocks = nn.ModuleList([
            VisionBlock(config.embed_dim, config.num_heads, int(config.embed_dim * config.mlp_ratio), norm="layer",
                        mlp="plain", act=config.hidden_act, tp_size=tp, multimodal_config=multimodal_config,
                        prefix=f"blocks.{i}", device=device, dtype=dtype)
            for i in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, config.embed_dim, self.merge, norm="layer", tp_size=tp,
                                  device=device, dtype=dtype)
        self._plans = LRUCache(8)  # (grid, device) -> PackPlan (device tensors)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return merged_tokens(grid_thw, self.merge)

    def plan(self, grid_thw: torch.Tensor, device) -> PackPlan:
        grid = read_grid(grid_thw, self.merge)

        def make():
            cu, max_len = make_cu_seqlens(frame_lengths(grid), device)
            cos, sin = self.rotary.tables(grid, device)
            return PackPlan(num_patches(grid), cu, max_len, cos, sin)
        return self._plans.get((grid, str(device)), make)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan(grid_thw, pixel_values.device)
        check_patch_count(pixel_values, plan)
        x = self.patch_embed(pixel_values)  # [T, embed_dim]
        for block in self.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, (plan.cos, plan.sin))
        return TowerOutput(self.merger(x))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self.weight_map)


def qwen_vl_processor(preprocessor_config: Mapping[str, Any]):
    """The Qwen2-VL / Qwen2.5-VL image processor (mmenc.preprocess.qwen_vl), imported when first needed."""
    return importlib.import_module("mmenc.preprocess.qwen_vl").qwen2_vl_from_hf(preprocessor_config)


def _builtin(arch: str, model_type: str, vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, "torch_dtype": "bfloat16",
            "hidden_size": text_hidden, "vision_config": vision}


def _qwen2_vl_builtin(text_hidden: int) -> dict[str, Any]:
    vision = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
              "hidden_size": text_hidden, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
              "temporal_patch_size": 2}
    return _builtin("Qwen2VLForConditionalGeneration", "qwen2_vl", vision, text_hidden)


QWEN2_VL_SPEC = register_model(ModelSpec(
    architectures=("Qwen2VLForConditionalGeneration",),
    tower_cls=Qwen2VisionTower,
    config_from_hf=Qwen2VisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=qwen_vl_processor,
    builtin_configs={
        "Qwen/Qwen2-VL-2B-Instruct": _qwen2_vl_builtin(1536),
        "Qwen/Qwen2-VL-7B-Instruct": _qwen2_vl_builtin(3584),
        "Qwen/Qwen2-VL-72B-Instruct": _qwen2_vl_builtin(8192),
    },
))
