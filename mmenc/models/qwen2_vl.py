"""Qwen2-VL vision tower: patch embedding, 2-D rotary, LayerNorm + QuickGELU blocks, 2x2 patch merger.

Every token attends to the other patches of its own frame (an image is one frame; a video of t
temporal patches is t frames). Tokens stay in merge-block order throughout, so the merger's 2x2
blocks are contiguous.
"""
import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model


@dataclasses.dataclass(frozen=True)
class Qwen2VisionConfig(TowerConfigBase):
    """Qwen2-VL's vision_config. Defaults are transformers' Qwen2VLVisionConfig defaults.

    embed_dim: the tower's width; hidden_size: the output width (the language model's hidden size).
    """

    width_field: ClassVar[str] = "embed_dim"
    hf_aliases: ClassVar = {"in_channels": ("in_channels", "in_chans"), "patch_size": ("patch_size", "spatial_patch_size")}
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


class Qwen2VisionTower(VisionTower):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, hidden_size], images in grid order."""

    # the merger's nn.Sequential indices become fc1 / fc2
    weight_map = WeightMap([("merger.mlp.0.", "merger.fc1.", None), ("merger.mlp.2.", "merger.fc2.", None)])

    def __init__(self, config: Qwen2VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.embed_dim, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=False, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, int(dim * config.mlp_ratio), norm="layer", mlp="plain",
                        act=config.hidden_act, prefix=f"blocks.{i}", **dd)
            for i in range(config.depth)])
        self.merger = PatchMerger(config.hidden_size, dim, self.merge, norm="layer", **dd)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        return frame_plan(grid, device, self.rotary)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [T, embed_dim]
        for block in self.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, (plan.cos, plan.sin))
        return TowerOutput(self.merger(x))


def _qwen2_vl_builtin(text_hidden: int) -> dict:
    vision = {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
              "hidden_size": text_hidden, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
              "temporal_patch_size": 2}
    return builtin_config("Qwen2VLForConditionalGeneration", "qwen2_vl", vision, hidden_size=text_hidden)


QWEN2_VL_SPEC = register_model(ModelSpec(
    architectures=("Qwen2VLForConditionalGeneration",),
    vision_architectures=("Qwen2VisionTransformerPretrainedModel",),
    tower_cls=Qwen2VisionTower,
    config_from_hf=Qwen2VisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=processor_for("qwen2_vl"),
    builtin_configs={
        "Qwen/Qwen2-VL-2B-Instruct": _qwen2_vl_builtin(1536),
        "Qwen/Qwen2-VL-7B-Instruct": _qwen2_vl_builtin(3584),
        "Qwen/Qwen2-VL-72B-Instruct": _qwen2_vl_builtin(8192),
    },
))
