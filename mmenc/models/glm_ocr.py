"""GLM-OCR vision tower (transformers' GlmOcrVisionModel; GLM-4.1V lineage, no learned position table).

  patch embedding (conv with bias; no post-conv norm, no position table)
  -> blocks: RMSNorm, attention per frame (qkv and proj bias = attention_bias) with q/k RMS-normalised
    per head, then 2-D rotary; RMSNorm, SwiGLU MLP of width intermediate_size (bias = attention_bias)
  -> RMSNorm (post_layernorm) -> downsample: merge x merge conv, stride merge (hidden -> out_hidden, bias)
  -> merger: proj -> LayerNorm -> GELU -> SwiGLU of width out_hidden_size * in_channels (no biases).

Tokens stay in merge-block order (as the processor emits them), so each merge block is contiguous for
the downsample. A (t, h, w) grid row attends per frame, h x w tokens each.
"""
import dataclasses
from typing import Any

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.merge import ConvDownsample, GatedMerger
from mmenc.layers.norm import RMSNorm
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model


@dataclasses.dataclass(frozen=True)
class GlmOcrVisionConfig(TowerConfigBase):
    """GLM-OCR's vision_config. Defaults are transformers' GlmOcrVisionConfig defaults (zai-org/GLM-OCR).

    hidden_size: the tower's width; intermediate_size: the blocks' MLP width; out_hidden_size: the
    output width (the language model's); the merger's SwiGLU is out_hidden_size * in_channels wide.
    """

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    out_hidden_size: int = 1536
    hidden_act: str = "silu"
    attention_bias: bool = True
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size")
        self.check_rotary_heads()

    def processor_defaults(self) -> dict[str, Any]:
        """The processor class the published checkpoints name (mmenc's GLM-4.1V processor ignores it;
        transformers has no processor registered for every GLM model_type)."""
        return {"image_processor_type": "Glm4vImageProcessor"}


class GlmOcrVisionTower(VisionTower):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, out_hidden_size], images in grid order."""

    # separate gate/up projections (blocks and merger) land in one merged parameter
    weight_map = WeightMap([(".gate_proj.", ".gate_up_proj.", 0), (".up_proj.", ".gate_up_proj.", 1)])
    plan_cache_size = 32

    def __init__(self, config: GlmOcrVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, eps, bias, dd = config.hidden_size, config.rms_norm_eps, config.attention_bias, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="rms", norm_eps=eps, mlp="gated",
                        act=config.hidden_act, qkv_bias=bias, mlp_bias=bias, qk_norm="head", qk_norm_eps=eps,
                        prefix=f"blocks.{i}", **dd)
            for i in range(config.depth)])
        self.post_layernorm = RMSNorm(dim, eps, **dd)
        self.downsample = ConvDownsample(dim, config.out_hidden_size, self.merge, **dd)
        self.merger = GatedMerger(config.out_hidden_size, config.out_hidden_size * config.in_channels,
                                  config.hidden_act, **dd)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        return frame_plan(grid, device, self.rotary)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [T, hidden]
        rotary = (plan.cos, plan.sin)
        for block in self.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        x = self.downsample(self.post_layernorm(x))  # [T / m^2, out_hidden]
        return TowerOutput(self.merger(x))


# zai-org/GLM-OCR: transformers' GlmOcrVisionConfig defaults are the published vision sizes; the
# language model's width equals out_hidden_size (1536), which the merger produces.
_GLM_OCR_VISION = {"depth": 24, "hidden_size": 1024, "num_heads": 16, "intermediate_size": 4096,
                   "out_hidden_size": 1536, "hidden_act": "silu", "attention_bias": True, "in_channels": 3,
                   "image_size": 336, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
                   "rms_norm_eps": 1e-5, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}

GLM_OCR_SPEC = register_model(ModelSpec(
    architectures=("GlmOcrForConditionalGeneration",),
    vision_architectures=("GlmOcrVisionModel",),
    tower_cls=GlmOcrVisionTower,
    config_from_hf=GlmOcrVisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=processor_for("glm4v"),
    builtin_configs={"zai-org/GLM-OCR": builtin_config("GlmOcrForConditionalGeneration", "glm_ocr", _GLM_OCR_VISION,
                                                       text_config={"hidden_size": 1536})},
))
