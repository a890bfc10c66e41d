"""ERNIE-4.5-VL vision tower (transformers' Ernie4_5_VLMoeVisionTransformerPretrainedModel) with its
resampler (Ernie4_5_VLMoeVariableResolutionResamplerModel), so the output is what the language model
consumes.

  patch embedding (linear, no bias, over [C*p*p] rows)
  -> Qwen2-VL-style blocks: LayerNorm, attention per frame with 2-D rotary (qkv/proj biases),
    LayerNorm, fc1 -> QuickGELU -> fc2
  -> LayerNorm (ln)
  -> resampler: each m x m block of patches as one vector -> spatial_linear (fc1 -> GELU -> fc2 -> LayerNorm)
     -> temporal pairs: frames (0, 1), (2, 3), ... concatenated (a single frame with itself; an odd
        last frame of a video is dropped, as transformers does) -> temporal_linear (2x wide in)
     -> mlp (to the language model's width) -> RMSNorm (after_norm).

Tokens stay in merge-block order (the processor emits them so). A (t, h, w) row yields
max(t // 2, 1) * h * w / m^2 embeddings.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mmenc.layers.norm import LayerNorm, RMSNorm
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import (ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config,
                               language_width, processor_for)
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class Ernie4_5VisionConfig(TowerConfigBase):
    """ERNIE-4.5-VL's vision_config (+ the language model's width and RMSNorm eps, which the resampler
    uses). Defaults are transformers' Ernie4_5_VLMoeVisionConfig defaults (baidu/ERNIE-4.5-VL-28B-A3B)."""

    hf_aliases: ClassVar = {"temporal_patch_size": (), "out_hidden_size": (), "text_rms_norm_eps": ()}
    depth: int = 32
    hidden_size: int = 1280
    num_heads: int = 16
    intermediate_size: int = 5120
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    temporal_merge_size: int = 2
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    out_hidden_size: int = 2560
    text_rms_norm_eps: float = 1e-5

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
                            "spatial_merge_size", "out_hidden_size")
        self.check_rotary_heads()
        if self.temporal_merge_size != 2:
            raise ValueError(f"Ernie4_5VisionConfig.temporal_merge_size={self.temporal_merge_size}; the resampler "
                             f"pairs frames, so it must be 2 (as in transformers)")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        text = config.get("text_config") or (config if "vision_config" in config else {})
        width = language_width(config)
        out = {} if width is None else {"out_hidden_size": width}
        if text.get("rms_norm_eps") is not None:
            out["text_rms_norm_eps"] = float(text["rms_norm_eps"])
        return out


class ResamplerMLP(nn.Module):
    """fc1 (column) -> GELU -> fc2 (row) -> LayerNorm: x [N, in_dim] -> [N, out_dim]."""

    def __init__(self, in_dim: int, out_dim: int, eps: float, prefix: str, device=None, dtype=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(in_dim, out_dim, prefix=f"{prefix}.fc1", device=device, dtype=dtype)
        self.act = nn.GELU()
        self.fc2 = RowParallelLinear(out_dim, out_dim, prefix=f"{prefix}.fc2", device=device, dtype=dtype)
        self.ln = LayerNorm(out_dim, eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.fc2(self.act(self.fc1(x))))


@dataclasses.dataclass
class ErniePlan(PackPlan):
    """PackPlan + the resampler's frame pairs: rows (int64 [N_out]) of the merged tokens whose
    concatenation [x[first] | x[second]] feeds temporal_linear."""

    first: torch.Tensor | None = None
    second: torch.Tensor | None = None


def temporal_pairs(grid: Grid, merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Host int64 [N_out] x 2: per grid row, frames (0, 1), (2, 3), ... of merged tokens (a single
    frame paired with itself)."""
    first, second, offset = [], [], 0
    for t, h, w in grid:
        n = h * w // merge_size ** 2
        for even, odd in zip(range(0, t, 2), range(1 if t > 1 else 0, t, 2)):
            first.append(torch.arange(n) + offset + even * n)
            second.append(torch.arange(n) + offset + odd * n)
        offset += t * n
    return torch.cat(first), torch.cat(second)


class Ernie4_5VisionTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (merge-block order), grid_thw int64 [N, 3] on CPU) -> TowerOutput
    with embeddings [sum max(t // 2, 1) * h * w / m^2, text hidden size], grid rows in order."""

    plan_cache_size = 32
    # the published checkpoints number the resampler MLPs' layers (nn.Sequential indices)
    weight_map = WeightMap([(f"{mlp}_linear.{i}.", f"{mlp}_linear.{name}.", None)
                            for mlp in ("spatial", "temporal") for i, name in ((0, "fc1"), (2, "fc2"), (3, "ln"))])

    def __init__(self, config: Ernie4_5VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, eps, dd = config.hidden_size, config.rms_norm_eps, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=False, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=eps, mlp="plain",
                        act=config.hidden_act, prefix=f"blocks.{i}", **dd)
            for i in range(config.depth)])
        self.ln = LayerNorm(dim, eps, **dd)
        merged = dim * self.merge ** 2
        self.spatial_linear = ResamplerMLP(merged, merged, eps, "spatial_linear", **dd)
        self.temporal_linear = ResamplerMLP(merged * config.temporal_merge_size, merged, eps, "temporal_linear", **dd)
        self.mlp = ReplicatedLinear(merged, config.out_hidden_size, prefix="mlp", **dd)
        self.after_norm = RMSNorm(config.out_hidden_size, config.text_rms_norm_eps, **dd)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """max(t // 2, 1) * h * w / merge^2 per grid row: the resampler merges frame pairs."""
        return [max(t // 2, 1) * h * w // self.merge ** 2 for t, h, w in self.read_grid(grid_thw)]

    def make_plan(self, grid: Grid, device) -> ErniePlan:
        base = frame_plan(grid, device, self.rotary)
        first, second = temporal_pairs(grid, self.merge)
        return ErniePlan(**{f.name: getattr(base, f.name) for f in dataclasses.fields(PackPlan)},
                         first=to_device(first, device), second=to_device(second, device))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [T, hidden]
        rotary = (plan.cos, plan.sin)
        for block in self.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        x = self.ln(x)
        x = self.spatial_linear(x.reshape(-1, x.shape[-1] * self.merge ** 2))  # [T / m^2, m^2 * hidden]
        x = self.temporal_linear(torch.cat([x[plan.first], x[plan.second]], dim=-1))
        return TowerOutput(self.after_norm(self.mlp(x)))


def _builtin(text_hidden: int) -> dict:
    # baidu/ERNIE-4.5-VL-28B-A3B(-PT) and -424B-A47B: one vision tower (transformers' vision defaults: 32
    # layers, 1280 wide, 16 heads, MLP 5120, QuickGELU); the resampler ends at the language model's width.
    vision = {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 5120, "hidden_act": "quick_gelu",
              "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_merge_size": 2,
              "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
    return builtin_config("Ernie4_5_VLMoeForConditionalGeneration", "ernie4_5_vl_moe", vision,
                          text_config={"hidden_size": text_hidden, "rms_norm_eps": 1e-5})


ERNIE4_5_VL_SPEC = register_model(ModelSpec(
    architectures=("Ernie4_5_VLMoeForConditionalGeneration", "Ernie4_5_VL_MoeForConditionalGeneration"),
    tower_cls=Ernie4_5VisionTower,
    config_from_hf=Ernie4_5VisionConfig.from_hf,
    # one group: the tower and its resampler sit side by side; save_pretrained writes the published names
    # (model.vision_model.*, resampler MLPs as spatial_linear.0/2/3), transformers' modules use vision_tower
    weight_prefixes=(("model.vision_model.", "model.resampler_model."),
                     ("model.vision_tower.", "model.resampler_model.")),
    processor_from_hf=processor_for("ernie4_5_vl_moe"),
    builtin_configs={
        "baidu/ERNIE-4.5-VL-28B-A3B-PT": _builtin(2560),
        "baidu/ERNIE-4.5-VL-424B-A47B-PT": _builtin(8192),
    },
))
