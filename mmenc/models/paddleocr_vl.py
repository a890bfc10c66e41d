"""PaddleOCR-VL vision tower (transformers' PaddleOCRVisionModel) with its projector, so the output is
what the language model consumes.

  patch embedding (Conv2d with bias over [C, p, p] rows) + learned position table (image_size /
  patch_size per side) resampled bilinearly (align_corners=False) to each frame's h x w grid
  -> SigLIP blocks: LayerNorm, attention per frame with 2-D rotary (q/k/v/out biases), LayerNorm,
    fc1 -> GELU(tanh) -> fc2
  -> LayerNorm (post_layernorm)
  -> projector: LayerNorm (eps 1e-5) -> merge m x m neighbours -> linear_1 -> GELU -> linear_2.

The processor emits each image's patches in raster order; the tower gathers them into merge-block
order once (rotary and position taps follow), so the projector's m x m blocks are contiguous.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.merge import merge_block_order
from mmenc.layers.norm import LayerNorm
from mmenc.layers.plan import PackPlan
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import SIGLIP_ENCODER_RULES, WeightMap
from mmenc.models.base import (ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config,
                               language_width, processor_for)
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class PaddleOCRVisionConfig(TowerConfigBase):
    """PaddleOCR-VL's vision_config (+ the language model's width, which the projector produces).
    Defaults are transformers' PaddleOCRVisionConfig defaults (PaddlePaddle/PaddleOCR-VL)."""

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "out_hidden_size": ()}
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 1024
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    image_size: int = 384
    patch_size: int = 14
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    layer_norm_eps: float = 1e-6
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "image_size", "patch_size", "spatial_merge_size")
        self.check_rotary_heads()
        if self.temporal_patch_size != 1:
            raise ValueError(f"PaddleOCRVisionConfig.temporal_patch_size={self.temporal_patch_size}; the tower "
                             f"embeds single frames (Conv2d), so it must be 1")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        width = language_width(config)
        return {} if width is None else {"out_hidden_size": width}

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class PaddleOCRVisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p], rows in the processor's raster order per frame;
    grid_thw int64 [N, 3] on CPU) -> TowerOutput with embeddings [T / merge^2, text hidden size]."""

    weight_map = WeightMap([
        ("embeddings.patch_embedding.", "embeddings.patch_embedding.proj.", None),
        *SIGLIP_ENCODER_RULES,
        ("pre_norm.", "merger.ln_q.", None),
        ("linear_1.", "merger.fc1.", None),
        ("linear_2.", "merger.fc2.", None),
    ])
    plan_cache_size = 32

    def __init__(self, config: PaddleOCRVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, m, dd = config.hidden_size, self.merge, self.factory_kwargs
        vm = self.vision_model = nn.Module()  # the checkpoint's module tree: vision_model.{embeddings,encoder,...}
        vm.embeddings = nn.Module()
        vm.embeddings.patch_embedding = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        vm.embeddings.position_embedding = InterpolatedPosEmbed(config.num_positions, dim, mode="bilinear",
                                                                align_corners=False, merge_size=m, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=m)
        vm.encoder = nn.Module()
        vm.encoder.layers = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.layer_norm_eps,
                        mlp="plain", act=config.hidden_act, prefix=f"vision_model.encoder.layers.{i}", **dd)
            for i in range(config.depth)])
        vm.post_layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.merger = PatchMerger(config.out_hidden_size, dim, m, norm="layer", norm_eps=1e-5, act="gelu", **dd)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        cu, max_len = make_cu_seqlens(frame_lengths(grid), device)
        cos, sin = self.rotary.tables(grid, device)
        index, weight = self.vision_model.embeddings.position_embedding.taps(grid, device)
        return PackPlan(num_patches(grid), cu, max_len, cos, sin, pos_index=index, pos_weight=weight,
                        token_order=to_device(merge_block_order(grid, self.merge), device))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        vm = self.vision_model
        x = vm.embeddings.patch_embedding(pixel_values.reshape(plan.num_patches, -1)[plan.token_order])
        x = x + vm.embeddings.position_embedding(plan.pos_index, plan.pos_weight).to(x.dtype)  # [T, hidden]
        rotary = (plan.cos, plan.sin)
        for block in vm.encoder.layers:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        return TowerOutput(self.merger(vm.post_layernorm(x)))  # [T / m^2, text hidden]


# PaddlePaddle/PaddleOCR-VL (0.9B): transformers' PaddleOCRVisionConfig defaults are its published vision
# sizes (SigLIP-so400m-like NaViT); its language model (ERNIE-4.5-0.3B) is 1024 wide.
_PADDLEOCR_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                     "num_attention_heads": 16, "num_channels": 3, "image_size": 384, "patch_size": 14,
                     "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "spatial_merge_size": 2}

PADDLEOCR_VL_SPEC = register_model(ModelSpec(
    architectures=("PaddleOCRVLForConditionalGeneration",),
    tower_cls=PaddleOCRVisionTower,
    config_from_hf=PaddleOCRVisionConfig.from_hf,
    # one group: the tower and its projector sit side by side
    weight_prefixes=(("model.visual.", "model.projector."), ("visual.", "mlp_AR.")),
    processor_from_hf=processor_for("paddleocr_vl"),
    builtin_configs={"PaddlePaddle/PaddleOCR-VL": builtin_config(
        "PaddleOCRVLForConditionalGeneration", "paddleocr_vl", _PADDLEOCR_VISION, text_config={"hidden_size": 1024})},
))
