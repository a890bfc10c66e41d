"""GLM-4.1V vision tower (GLM-4.5V's Glm4vMoe model carries the same tower).

  patch embedding (conv with bias) -> RMSNorm (post_conv_layernorm)
  + learned position table (image_size/patch_size per side) resampled to each frame's h x w grid,
    bicubic (Keys a=-0.75), half-pixel centres, taps clamped to the border -- as transformers'
    F.grid_sample(..., align_corners=False, padding_mode="border")
  -> blocks: RMSNorm, attention per frame with 2-D rotary (qkv bias = attention_bias, proj without
    bias), RMSNorm, SwiGLU MLP of width out_hidden_size (no biases)
  -> RMSNorm (post_layernorm) -> downsample: a merge x merge conv with stride merge (hidden ->
    out_hidden, bias), one matmul over each contiguous merge block
  -> merger: proj (no bias) -> LayerNorm (eps 1e-5) -> GELU -> SwiGLU (intermediate_size, no biases).

Tokens stay in merge-block order, so each merge x merge block is contiguous for the downsample.
Each frame's position table uses its own item's (h, w); transformers' model feeds videos to the
tower as t rows of (1, h, w), which is the same computation.

The downsample is replicated over tensor-parallel ranks; everything else is sharded like the other towers.
"""
import dataclasses
from typing import Any

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.merge import ConvDownsample, GatedMerger
from mmenc.layers.norm import RMSNorm
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import GatedVisionMLP, PatchEmbed, VisionAttention
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model


@dataclasses.dataclass(frozen=True)
class Glm4vVisionConfig(TowerConfigBase):
    """GLM-4.1V's vision_config. Defaults are transformers' Glm4vVisionConfig defaults (GLM-4.1V-9B).

    hidden_size: the tower's width; out_hidden_size: the output width (the language model's), also
    the blocks' MLP width; intermediate_size: the merger's SwiGLU width.
    """

    depth: int = 24
    hidden_size: int = 1536
    num_heads: int = 12
    intermediate_size: int = 13696
    out_hidden_size: int = 4096
    hidden_act: str = "silu"
    attention_bias: bool = False
    in_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "image_size", "patch_size", "temporal_patch_size", "spatial_merge_size")
        self.check_rotary_heads()
        if self.image_size % self.patch_size:
            raise ValueError(f"Glm4vVisionConfig.image_size={self.image_size} must be a multiple of "
                             f"patch_size={self.patch_size} (the learned position grid is image_size/patch_size)")

    def processor_defaults(self) -> dict[str, Any]:
        """The processor class the published checkpoints name (mmenc's GLM-4.1V processor ignores it;
        transformers has no processor registered for every GLM model_type)."""
        return {"image_processor_type": "Glm4vImageProcessor"}

    @property
    def num_positions(self) -> int:
        return (self.image_size // self.patch_size) ** 2


class Glm4vBlock(nn.Module):
    """x + attn(norm1(x)), then x + mlp(norm2(x)); RMSNorm, SwiGLU, no biases but the optional qkv one."""

    def __init__(self, config: Glm4vVisionConfig, prefix: str, device=None, dtype=None):
        super().__init__()
        dim, eps = config.hidden_size, config.rms_norm_eps
        self.norm1 = RMSNorm(dim, eps, device=device, dtype=dtype)
        self.norm2 = RMSNorm(dim, eps, device=device, dtype=dtype)
        self.attn = VisionAttention(dim, config.num_heads, qkv_bias=config.attention_bias, proj_bias=False,
                                    prefix=f"{prefix}.attn", device=device, dtype=dtype)
        self.mlp = GatedVisionMLP(dim, config.out_hidden_size, act=config.hidden_act, bias=False,
                                  prefix=f"{prefix}.mlp", device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                rotary: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen, rotary)
        return x + self.mlp(self.norm2(x))


class Glm4vVisionTower(VisionTower):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, out_hidden_size], images in grid order."""

    # separate gate/up projections (blocks and merger) land in one merged parameter; the position
    # table is a top-level module here
    weight_map = WeightMap([
        (".gate_proj.", ".gate_up_proj.", 0),
        (".up_proj.", ".gate_up_proj.", 1),
        ("embeddings.position_embedding.", "pos_embed.", None),
    ])
    plan_cache_size = 32

    def __init__(self, config: Glm4vVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, eps, m, dd = config.hidden_size, config.rms_norm_eps, self.merge, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.post_conv_layernorm = RMSNorm(dim, eps, **dd)
        self.pos_embed = InterpolatedPosEmbed(config.num_positions, dim, mode="bicubic", align_corners=False,
                                              merge_size=m, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=m)
        self.blocks = nn.ModuleList([Glm4vBlock(config, f"blocks.{i}", **dd)
                                     for i in range(config.depth)])
        self.post_layernorm = RMSNorm(dim, eps, **dd)
        # merge x merge conv, stride merge: one matmul over a block's m*m contiguous patches
        self.downsample = ConvDownsample(dim, config.out_hidden_size, m, **dd)
        self.merger = GatedMerger(config.out_hidden_size, config.intermediate_size, config.hidden_act, **dd)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        return frame_plan(grid, device, self.rotary, self.pos_embed)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.post_conv_layernorm(self.patch_embed(pixel_values))  # [T, hidden]
        x = x + self.pos_embed(plan.pos_index, plan.pos_weight).to(x.dtype)
        rotary = (plan.cos, plan.sin)
        for block in self.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        x = self.post_layernorm(x)
        x = self.downsample(x)  # [T / m^2, out_hidden]
        return TowerOutput(self.merger(x))


def _builtin(arch: str, model_type: str, intermediate: int) -> dict:
    vision = {"depth": 24, "hidden_size": 1536, "num_heads": 12, "intermediate_size": intermediate,
              "out_hidden_size": 4096, "hidden_act": "silu", "attention_bias": False, "in_channels": 3,
              "image_size": 336, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
              "rms_norm_eps": 1e-5}
    return builtin_config(arch, model_type, vision, text_config={"hidden_size": 4096})


GLM4V_SPEC = register_model(ModelSpec(
    architectures=("Glm4vForConditionalGeneration", "Glm4vMoeForConditionalGeneration"),
    vision_architectures=("Glm4vVisionModel", "Glm4vMoeVisionModel"),
    tower_cls=Glm4vVisionTower,
    config_from_hf=Glm4vVisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=processor_for("glm4v"),
    builtin_configs={
        "zai-org/GLM-4.1V-9B-Thinking": _builtin("Glm4vForConditionalGeneration", "glm4v", 13696),
        "zai-org/GLM-4.5V": _builtin("Glm4vMoeForConditionalGeneration", "glm4v_moe", 10944),
    },
))
