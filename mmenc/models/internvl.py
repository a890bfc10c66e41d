"""InternViT (InternVL 2.5 / 3 / 3.5: InternViT-300M and InternViT-6B) with InternVL's projector.

An image is a stack of fixed-size tiles (448 px: InternVL's dynamic tiling plus a thumbnail), one
grid row (tiles, h, w) per image; every tile is its own sequence. Per tile the tower runs:
  patch embedding (Conv2d with bias, as a matmul); a CLS token in front; the learned position table
  (CLS row + a side x side grid; resampled bicubically when a tile is not side x side patches);
  pre-norm blocks (LayerNorm for 300M, RMSNorm for 6B): q/k/v (bias: attention_bias), optional
  RMSNorm of q and k over all heads (6B), output projection with bias, per-channel layer scales
  (lambda_1, lambda_2), GELU MLP; a final LayerNorm unless use_mean_pooling;
  the projector: CLS dropped, pixel shuffle (each 2x2 block of patches concatenated), LayerNorm,
  linear_1 -> GELU -> linear_2.
Embeddings the language model consumes: transformers' InternVLModel.get_image_features(...).pooler_output,
tiles concatenated: [tiles * h*w / 4, text hidden] per image.

Tiles of one size (the normal case) run as one dense [tiles, 1 + h*w, D] batch (attention over its
rows, given as uniform segments made once per grid); tiles of different sizes are packed (one segment
per tile, CLS rows interleaved). Patches are permuted on input from the
processor's raster order to merge-block order, so the pixel shuffle is a reshape.
"""
import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.norm import LayerNorm
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import grid_positions
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device

_NORMS = {"layer_norm": "layer", "rms_norm": "rms"}


@dataclasses.dataclass(frozen=True)
class InternVisionConfig(TowerConfigBase):
    """InternVLVisionConfig plus the projector's settings (top level of config.json). Defaults are
    transformers' InternVLVisionConfig / InternVLConfig defaults (InternViT-300M, downsample 0.5).

    hidden_size: the tower's width; out_hidden_size: the language model's (text_config.hidden_size);
    norm: "layer_norm" or "rms_norm"; final_norm: a LayerNorm after the blocks (not use_mean_pooling).
    """

    hf_aliases: ClassVar = {
        "depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",), "in_channels": ("num_channels",),
        "qkv_bias": ("attention_bias",), "qk_norm": ("use_qk_norm",), "norm": ("norm_type",),
        "norm_eps": ("layer_norm_eps",), "image_size": (), "patch_size": (), "final_norm": (),
        "out_hidden_size": (), "spatial_merge_size": (), "projector_act": (),
    }
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    qkv_bias: bool = False
    qk_norm: bool = False
    norm: str = "layer_norm"
    norm_eps: float = 1e-6
    final_norm: bool = False
    in_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    out_hidden_size: int = 896
    spatial_merge_size: int = 2
    projector_act: str = "gelu"

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "image_size",
                            "patch_size", "out_hidden_size", "spatial_merge_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"InternVisionConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}")
        if self.norm not in _NORMS:
            raise ValueError(f"InternVisionConfig.norm={self.norm!r}; expected one of {sorted(_NORMS)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"InternVisionConfig: image_size={self.image_size} is not a multiple of "
                             f"patch_size={self.patch_size}")

    @property
    def temporal_patch_size(self) -> int:
        return 1

    def processor_defaults(self) -> dict[str, Any]:
        """The published checkpoints' processor keys (mmenc's InternVL processor has the same defaults):
        GotOcr2ImageProcessor, 448 px tiles, cropping on (InternVLProcessor turns it on when it calls the image
        processor; the image processor's own defaults are 384 px and off)."""
        return {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True,
                "size": {"height": 448, "width": 448}}

    @property
    def side(self) -> int:
        """Patches per side of a native tile (the learned position grid)."""
        return self.image_size // self.patch_size

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """Square sizes from int-or-pair keys, the merge from downsample_ratio, the projector from the top
        level; variants this tower does not implement raise ValueError."""
        values = {"final_norm": not vision.get("use_mean_pooling", True)}
        for key in ("image_size", "patch_size"):
            value = vision.get(key)
            if isinstance(value, (list, tuple)):
                if len(value) != 2 or value[0] != value[1]:
                    raise ValueError(f"vision_config.{key}={list(value)}; only square sizes are supported")
                value = value[0]
            if value is not None:
                values[key] = int(value)
        if not vision.get("use_absolute_position_embeddings", True) or vision.get("use_mask_token"):
            raise ValueError("vision_config: use_absolute_position_embeddings=False or use_mask_token=True is not "
                             "supported; InternViT checkpoints use absolute positions and no mask token")
        ratio = float(config.get("downsample_ratio", 0.5))
        merge = round(1 / ratio)
        if not math.isclose(merge * ratio, 1.0):
            raise ValueError(f"downsample_ratio={ratio} is not supported; expected 1 / an integer (0.5)")
        layer, strategy = config.get("vision_feature_layer", -1), config.get("vision_feature_select_strategy",
                                                                              "default")
        if layer != -1 or strategy != "default":
            raise ValueError(f"vision_feature_layer={layer!r}, vision_feature_select_strategy={strategy!r} are not "
                             f"supported; expected -1 and 'default' (last layer, CLS token dropped)")
        values["spatial_merge_size"] = merge
        values["projector_act"] = config.get("projector_hidden_act", "gelu")
        text = config.get("text_config") or {}
        if text.get("hidden_size"):
            values["out_hidden_size"] = int(text["hidden_size"])
        return values


class InternPosEmbed(InterpolatedPosEmbed):
    """The checkpoint's position table [1, 1 + side*side, dim]: row 0 is the CLS token's, the rest a
    side x side grid resampled bicubically (align_corners=False) to each tile."""

    def __init__(self, side: int, dim: int, merge_size: int, device=None, dtype=None):
        super().__init__(side * side, dim, mode="bicubic", align_corners=False, merge_size=merge_size, device=device,
                         dtype=dtype)
        self.weight = nn.Parameter(torch.empty(1 + side * side, dim, device=device, dtype=dtype), requires_grad=False)
        self.weight.weight_loader = self._load_table

    def _load_table(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != param.numel() or loaded.shape[-1] != param.shape[-1]:
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected [1, {param.shape[0]}, {param.shape[1]}]")
        param.data.copy_(loaded.reshape(param.shape))

    def frame_taps(self, h: int, w: int) -> tuple[torch.Tensor, torch.Tensor]:
        index, weight = super().frame_taps(h, w)
        return index + 1, weight  # grid rows follow the CLS row


@dataclasses.dataclass
class InternPlan:
    """What a forward derives from grid_thw, once (device tensors, cached per grid).

    Dense (every tile h x w): x [tiles, 1 + h*w, D]; `order` [h*w] and taps for one tile; cu_seqlens
    its uniform rows (passed to attention so a compiled block needs no host work).
    Packed (mixed sizes): `order` [T] over all patches, taps for every patch, and `patch_slots` /
    `cls_slots`: each patch's / tile's CLS row in the packed sequence of T + tiles rows."""

    num_patches: int
    tiles: int
    dense: bool
    order: torch.Tensor
    pos_index: torch.Tensor
    pos_weight: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    patch_slots: torch.Tensor | None = None
    cls_slots: torch.Tensor | None = None


def _raster_to_blocks(h: int, w: int, merge: int) -> torch.Tensor:
    """int64 [h*w]: merge-block position i holds raster patch order[i]."""
    pos = grid_positions(h, w, merge)
    return pos[:, 0] * w + pos[:, 1]


class InternVisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p] (each tile's patches in raster order), grid_thw
    int64 [N, 3] = (tiles, h, w) on CPU) -> TowerOutput with embeddings [T / merge^2, out_hidden_size]."""

    weight_map = WeightMap([
        ("embeddings.patch_embeddings.projection.", "patch_embed.proj.", None),
        ("embeddings.position_embeddings", "pos_embed.weight", None),
        ("embeddings.cls_token", "cls_token", None),
        (".attention.q_proj.", ".attn.qkv.", "q"),
        (".attention.k_proj.", ".attn.qkv.", "k"),
        (".attention.v_proj.", ".attn.qkv.", "v"),
        (".attention.projection_layer.", ".attn.proj.", None),
        (".attention.q_norm.", ".attn.q_norm.", None),
        (".attention.k_norm.", ".attn.k_norm.", None),
        (".layernorm_before.", ".norm1.", None),
        (".layernorm_after.", ".norm2.", None),
        (".lambda_1", ".ls1", None),
        (".lambda_2", ".ls2", None),
        ("layer_norm.", "merger.ln_q.", None),
        ("linear_1.", "merger.fc1.", None),
        ("linear_2.", "merger.fc2.", None),
    ])
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: InternVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.cls_token = nn.Parameter(torch.zeros(dim, **dd), requires_grad=False)
        self.cls_token.weight_loader = self._load_cls
        self.pos_embed = InternPosEmbed(config.side, dim, self.merge, **dd)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm=_NORMS[config.norm],
                        norm_eps=config.norm_eps, mlp="plain", act=config.hidden_act, qkv_bias=config.qkv_bias,
                        proj_bias=True, layer_scale=True, qk_norm="all" if config.qk_norm else None,
                        prefix=f"encoder.layer.{i}", **dd)
            for i in range(config.depth)])
        self.layernorm = LayerNorm(dim, config.norm_eps, **dd) if config.final_norm else None
        self.merger = PatchMerger(config.out_hidden_size, dim, self.merge, norm="layer", norm_eps=1e-5,
                                  act=config.projector_act, norm_after_merge=True, mid_dim=config.out_hidden_size, **dd)

    def _load_cls(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != param.numel():
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected [1, 1, {param.numel()}]")
        param.data.copy_(loaded.reshape(param.shape))

    def make_plan(self, grid: Grid, device) -> InternPlan:
        sizes = {(h, w) for _, h, w in grid}
        tiles = sum(t for t, _, _ in grid)
        if len(sizes) == 1:
            (h, w), = sizes
            index, weight = self.pos_embed.frame_taps(h, w)
            cu, max_len = make_cu_seqlens([1 + h * w] * tiles, device)  # the dense batch's rows, made once
            return InternPlan(num_patches(grid), tiles, True, to_device(_raster_to_blocks(h, w, self.merge), device),
                              to_device(index, device), to_device(weight, device), cu, max_len)
        orders, patch_slots, cls_slots, offset, slot = [], [], [], 0, 0
        for h, w in ((h, w) for t, h, w in grid for _ in range(t)):
            orders.append(_raster_to_blocks(h, w, self.merge) + offset)
            cls_slots.append(slot)
            patch_slots.append(torch.arange(slot + 1, slot + 1 + h * w))
            offset, slot = offset + h * w, slot + 1 + h * w
        index, weight = self.pos_embed.taps(grid, device)
        cu, max_len = make_cu_seqlens([n + 1 for n in frame_lengths(grid)], device)
        return InternPlan(num_patches(grid), tiles, False, to_device(torch.cat(orders), device), index, weight, cu,
                          max_len, to_device(torch.cat(patch_slots), device), to_device(torch.tensor(cls_slots), device))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        pixels = pixel_values.reshape(plan.num_patches, -1)
        pos = self.pos_embed(plan.pos_index, plan.pos_weight)  # float32 [h*w or T, D]
        cls = (self.cls_token.float() + self.pos_embed.weight[0].float()).to(self.cls_token.dtype)  # [D]
        if plan.dense:  # [tiles, 1 + h*w, D], no cu_seqlens
            x = self.patch_embed(pixels.view(plan.tiles, -1, pixels.shape[-1])[:, plan.order].flatten(0, 1))
            x = (x.view(plan.tiles, -1, x.shape[-1]) + pos.to(x.dtype))
            x = torch.cat([cls.expand(plan.tiles, 1, -1), x], dim=1)
        else:  # packed [T + tiles, D], one segment per tile
            patches = self.patch_embed(pixels[plan.order])
            x = patches.new_empty(plan.num_patches + plan.tiles, patches.shape[-1])
            x[plan.patch_slots] = patches + pos.to(patches.dtype)
            x[plan.cls_slots] = cls
        for block in self.encoder.layer:
            x = block(x, plan.cu_seqlens, plan.max_seqlen)
        if self.layernorm is not None:
            x = self.layernorm(x)
        x = x[:, 1:].reshape(-1, x.shape[-1]) if plan.dense else x[plan.patch_slots]  # CLS dropped
        return TowerOutput(self.merger(x))  # [T / m^2, out_hidden]


# Published sizes (the -hf checkpoints' config.json): InternViT-300M-448px-V2_5 under InternVL3-1B/2B/8B/14B
# (Qwen2.5 0.5B/1.5B/7B/14B: text widths 896/1536/3584/5120), InternViT-6B-448px-V2_5 under InternVL3-78B
# (Qwen2.5-72B: 8192).
_VIT_300M = {"model_type": "internvl_vision", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
             "intermediate_size": 4096, "hidden_act": "gelu", "attention_bias": True, "use_qk_norm": False,
             "norm_type": "layer_norm", "layer_norm_eps": 1e-6, "image_size": [448, 448], "patch_size": [14, 14],
             "layer_scale_init_value": 0.1, "use_mean_pooling": True}
_VIT_6B = {**_VIT_300M, "hidden_size": 3200, "num_hidden_layers": 45, "num_attention_heads": 25,
           "intermediate_size": 12800, "attention_bias": False, "use_qk_norm": True, "norm_type": "rms_norm"}


def _internvl(vision: dict, text_hidden: int) -> dict:
    return builtin_config("InternVLForConditionalGeneration", "internvl", vision,
                          text_config={"hidden_size": text_hidden}, downsample_ratio=0.5, projector_hidden_act="gelu",
                          vision_feature_layer=-1, vision_feature_select_strategy="default")


INTERNVL_SPEC = register_model(ModelSpec(
    architectures=("InternVLForConditionalGeneration",),
    tower_cls=InternVisionTower,
    config_from_hf=InternVisionConfig.from_hf,
    # one group: tower and projector side by side (transformers >= 5 writes them under model.)
    weight_prefixes=(("model.vision_tower.", "model.multi_modal_projector."),
                     ("vision_tower.", "multi_modal_projector.")),
    processor_from_hf=processor_for("internvl"),
    builtin_configs={
        "OpenGVLab/InternVL3-1B-hf": _internvl(_VIT_300M, 896),
        "OpenGVLab/InternVL3-8B-hf": _internvl(_VIT_300M, 3584),
        "OpenGVLab/InternVL3-78B-hf": _internvl(_VIT_6B, 8192),
    },
))
