"""Llama 4 vision tower (`Llama4ForConditionalGeneration`'s vision_model + multi_modal_projector):
fixed square tiles, a CLS token, a learned position table, 2-D rotary, LayerNorm + GELU MLP blocks
with full attention per tile, then pixel shuffle, the vision adapter MLP and the projector.

Input: the processor cuts an image into k tiles of image_size x image_size pixels (mmenc.preprocess.
llama4): its grid_thw row is (k, s, s) with s = image_size / patch_size, and its pixel_values rows are
the tiles' patches, tile by tile, each tile's patches in raster order, one row (C, p, p) per patch.
Every tile runs as one row of a dense [tiles, s*s + 1, hidden] batch (the CLS token last), through
the shared blocks: no padding, no gathers; attention sees the rows as equal segments (cu_seqlens made
once per grid in the plan, so compiled blocks do no host work) and runs them as one batched call.

Rotary: token (row y, col x) rotates head pairs (2i, 2i+1) for i < D/4 by (x + 1) * f_i and the next
D/4 pairs by (y + 1) * f_i, f_i = theta ** (-4i / D); the CLS token is not rotated.

Pixel shuffle (ratio 1/m, m = 2): each m x m block of a tile's patch grid becomes one token whose
features are the block's patches in raster order (dy, dx), concatenated: [s*s, hidden] ->
[(s/m)^2, m*m*hidden]; then adapter fc1 -> GELU -> fc2 -> GELU, and the projector (no bias) to the
language model's width. Output rows: tile by tile, (s/m)^2 per tile, i.e. t * h * w / m^2 per image.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.activation import get_act_fn
from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.rotary import vision_inv_freq
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import (ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for,
                               vlm_config_dict)
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class Llama4VisionConfig(TowerConfigBase):
    """Llama 4's vision_config (defaults: the published Llama-4-Scout/Maverick vision config).

    image_size: the tile side in pixels; spatial_merge_size: 1 / pixel_shuffle_ratio;
    projector_input_dim / projector_output_dim: the adapter MLP's widths; vision_output_dim: the
    projector's input; out_hidden_size: its output (the language model's hidden size).
    """

    hf_aliases: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",), "in_channels": ("num_channels",),
        "temporal_patch_size": (), "spatial_merge_size": (), "out_hidden_size": (), "norm_eps": ()}

    depth: int = 34
    hidden_size: int = 1408
    num_heads: int = 16
    intermediate_size: int = 5632
    in_channels: int = 3
    image_size: int = 336
    patch_size: int = 14
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    projector_input_dim: int = 4096
    projector_output_dim: int = 4096
    vision_output_dim: int = 4096
    out_hidden_size: int = 5120
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5  # transformers builds nn.LayerNorm(hidden) (its default eps), not config.norm_eps

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "image_size",
                            "patch_size", "temporal_patch_size", "spatial_merge_size", "projector_input_dim",
                            "projector_output_dim", "vision_output_dim", "out_hidden_size")
        self.check_rotary_heads()
        side, m = self.image_size // self.patch_size, self.spatial_merge_size
        if self.image_size % self.patch_size or side % m:
            raise ValueError(f"Llama4VisionConfig: image_size={self.image_size} must be patch_size={self.patch_size} "
                             f"times a multiple of spatial_merge_size={m} (the pixel shuffle's block)")
        if self.intermediate_size != self.hidden_size * m * m:
            raise ValueError(f"Llama4VisionConfig: intermediate_size={self.intermediate_size} must equal hidden_size * "
                             f"{m * m} = {self.hidden_size * m * m} (the adapter reads pixel-shuffled tokens)")
        if not self.projector_input_dim == self.projector_output_dim == self.vision_output_dim:
            raise ValueError(f"Llama4VisionConfig: projector_input_dim={self.projector_input_dim}, projector_output_dim="
                             f"{self.projector_output_dim} and vision_output_dim={self.vision_output_dim} must be equal "
                             f"(the adapter's fc2 is square and feeds the projector)")

    @property
    def tile_side(self) -> int:
        """Patches per tile side."""
        return self.image_size // self.patch_size

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        ratio = float(vision.get("pixel_shuffle_ratio", 0.5))
        merge = round(1 / ratio)
        if abs(merge * ratio - 1) > 1e-6:
            raise ValueError(f"Llama4VisionConfig: pixel_shuffle_ratio={ratio} must be 1 / an integer")
        text = vlm_config_dict(config).get("text_config") or {}
        out = {"spatial_merge_size": merge}
        if text.get("hidden_size") is not None:
            out["out_hidden_size"] = int(text["hidden_size"])
        return out


@dataclasses.dataclass
class TilePlan:
    """A batch of tiles: num_patches rows, `tiles` tiles; rotary cos/sin float32 [s*s + 1, head_dim];
    cu_seqlens int32 [tiles + 1], max_seqlen: the tiles' equal segments (s*s + 1 tokens each)."""

    num_patches: int
    tiles: int
    cos: torch.Tensor
    sin: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int


def tile_rotary(side: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin float32 [side*side + 1, head_dim] for a tile's patches (raster order) and its CLS token
    (last; angle 0), laid out for apply_rotary(interleaved=True)."""
    f = vision_inv_freq(head_dim, theta)  # [D/4]
    idx = torch.arange(side * side)
    pos = torch.stack([idx % side, idx // side], dim=-1).float() + 1  # (x, y) + 1
    angles = (pos[:, :, None] * f).reshape(side * side, -1)  # [s*s, D/2]: x-angles | y-angles
    angles = torch.cat([angles, angles.new_zeros(1, angles.shape[-1])])  # CLS: not rotated
    full = angles.repeat_interleave(2, dim=-1)
    return full.cos(), full.sin()


class Llama4VisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p], grid_thw int64 [N, 3] of (tiles, s, s) rows, on CPU)
    -> TowerOutput(embeddings [T / m^2, out_hidden_size]), tile by tile."""

    # checkpoint (vision_model. / multi_modal_projector. removed) -> parameters; the blocks keep the
    # checkpoint's model.layers.N path, inside them the shared VisionBlock's names
    weight_map = WeightMap([
        (".self_attn.q_proj.", ".attn.qkv.", "q"), (".self_attn.k_proj.", ".attn.qkv.", "k"),
        (".self_attn.v_proj.", ".attn.qkv.", "v"), (".self_attn.o_proj.", ".attn.proj.", None),
        (".input_layernorm.", ".norm1.", None), (".post_attention_layernorm.", ".norm2.", None),
        ("patch_embedding.linear.", "patch_embedding.proj.", None),
        ("vision_adapter.mlp.", "adapter_", None),
        ("linear_1.", "projector.", None),
    ])

    def __init__(self, config: Llama4VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.patch_embedding = PatchEmbed(config.patch_features, dim, bias=False, prefix="patch_embedding", **dd)
        self.class_embedding = nn.Parameter(torch.empty(dim, **dd))
        self.positional_embedding_vlm = nn.Parameter(torch.empty(config.tile_side ** 2 + 1, dim, **dd))
        self.layernorm_pre = LayerNorm(dim, config.norm_eps, **dd)
        self.layernorm_post = LayerNorm(dim, config.norm_eps, **dd)
        self.model = nn.ModuleDict({"layers": nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.norm_eps,
                        mlp="plain", act="gelu", rotary_interleaved=True, prefix=f"model.layers.{i}", **dd)
            for i in range(config.depth)])})
        self.adapter_fc1 = ColumnParallelLinear(config.intermediate_size, config.projector_input_dim, bias=False,
                                                prefix="adapter_fc1", **dd)
        self.adapter_fc2 = RowParallelLinear(config.projector_input_dim, config.projector_output_dim, bias=False,
                                             prefix="adapter_fc2", **dd)
        self.act = get_act_fn("gelu")
        self.projector = ReplicatedLinear(config.vision_output_dim, config.out_hidden_size, bias=False,
                                          prefix="projector", **dd)

    def make_plan(self, grid: Grid, device) -> TilePlan:
        side = self.config.tile_side
        bad = [(i, g) for i, g in enumerate(grid) if g[1:] != (side, side)]
        if bad:
            i, g = bad[0]
            raise ValueError(f"grid_thw[{i}] = {g}: Llama 4 tiles are {side} x {side} patches; expected rows "
                             f"(tiles, {side}, {side}) as mmenc.preprocess.llama4 gives them")
        cos, sin = tile_rotary(side, self.config.head_dim, self.config.rope_theta)
        tiles = sum(t for t, _, _ in grid)
        cu, max_len = make_cu_seqlens([side * side + 1] * tiles, device)
        return TilePlan(tiles * side * side, tiles, to_device(cos, device), to_device(sin, device), cu, max_len)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        s, m, dim = self.config.tile_side, self.merge, self.config.hidden_size
        x = self.patch_embedding(pixel_values.reshape(plan.num_patches, -1)).view(plan.tiles, s * s, dim)
        cls = self.class_embedding.to(x.dtype).expand(plan.tiles, 1, dim)
        x = torch.cat([x, cls], dim=1) + self.positional_embedding_vlm.to(x.dtype)  # [B, s*s + 1, dim]
        x = self.layernorm_pre(x)
        for block in self.model["layers"]:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, (plan.cos, plan.sin))  # dense: each tile to itself
        x = self.layernorm_post(x)[:, :-1]  # drop CLS
        # pixel shuffle: [B, s/m, dy, s/m, dx, dim] -> [B, s/m, s/m, dy, dx, dim] -> [B*(s/m)^2, m*m*dim]
        x = x.reshape(plan.tiles, s // m, m, s // m, m, dim).permute(0, 1, 3, 2, 4, 5).reshape(-1, m * m * dim)
        x = self.act(self.adapter_fc2(self.act(self.adapter_fc1(x))))
        return TowerOutput(self.projector(x))


# The published vision_config of Llama-4-Scout-17B-16E and Llama-4-Maverick-17B-128E (the same tower):
# 34 layers of 1408 (16 heads of 88), MLP 5632, 336 px tiles of 14 px patches, pixel shuffle 0.5,
# adapter 5632 -> 4096 -> 4096, rope_theta 10000; the projector maps 4096 to the text hidden size 5120.
_VISION = {"num_hidden_layers": 34, "hidden_size": 1408, "num_attention_heads": 16, "intermediate_size": 5632,
           "num_channels": 3, "image_size": 336, "patch_size": 14, "pixel_shuffle_ratio": 0.5,
           "projector_input_dim": 4096, "projector_output_dim": 4096, "vision_output_dim": 4096,
           "hidden_act": "gelu", "norm_eps": 1e-5, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
_ARCH = "Llama4ForConditionalGeneration"

LLAMA4_SPEC = register_model(ModelSpec(
    architectures=(_ARCH,),
    tower_cls=Llama4VisionTower,
    config_from_hf=Llama4VisionConfig.from_hf,
    weight_prefixes=(("vision_model.", "multi_modal_projector."),
                     ("model.vision_model.", "model.multi_modal_projector.")),
    processor_from_hf=processor_for("llama4"),
    builtin_configs={name: builtin_config(_ARCH, "llama4", _VISION, text_config={"hidden_size": 5120})
                     for name in ("meta-llama/Llama-4-Scout-17B-16E-Instruct",
                                  "meta-llama/Llama-4-Maverick-17B-128E-Instruct")},
))
