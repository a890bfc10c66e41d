"""HunyuanOCR vision tower (transformers' HunYuanVLVisionTransformer), merger included.

  patch embedding (Conv2d with bias over [C*p*p] rows) + learned position table (max_image_size /
  patch_size per side, after one unused class-token row) resampled bilinearly (align_corners=False)
  to each image's h x w grid
  -> SigLIP blocks without rotary: LayerNorm, attention per image (q/k/v/o biases), LayerNorm,
    fc1 -> GELU -> fc2
  -> perceive (the merger): RMSNorm -> merge x merge conv, stride merge (hidden -> 2 hidden) -> GELU
     -> 1x1 conv (-> 4 hidden) -> a learned newline vector after every row of merged tokens -> linear
     (-> language width) -> [image_begin, rows..., image_end] -> RMSNorm.

An image of h x w patches yields (h/m) * (w/m + 1) + 2 embeddings. The processor emits raster rows;
the tower gathers them into merge-block order once, and places the merged rows, newlines, begin and
end with one gather. transformers' tower takes still images only; a (t, h, w) row is run here as t
images of (1, h, w).
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.activation import get_act_fn
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.merge import ConvDownsample, merge_block_order
from mmenc.layers.norm import RMSNorm
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.row_blocks import LOW_INTERMEDIATE_BYTES
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import (ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config,
                               language_width, processor_for)
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class HunyuanVisionConfig(TowerConfigBase):
    """HunyuanOCR's vision_config. Defaults are transformers' HunYuanVLVisionConfig defaults but the
    output width (text_hidden_size), which is HunyuanOCR's language width 1024 (tencent/HunyuanOCR)."""

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "out_hidden_size": ("text_hidden_size",),
                            "temporal_patch_size": ()}
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 1024
    hidden_act: str = "gelu"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 1
    spatial_merge_size: int = 2
    max_image_size: int = 2048
    interpolate_mode: str = "bilinear"
    rms_norm_eps: float = 1e-5

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "patch_size", "spatial_merge_size", "max_image_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"HunyuanVisionConfig: hidden_size={self.hidden_size} must be a multiple of "
                             f"num_heads={self.num_heads}")
        if self.interpolate_mode not in ("bilinear", "bicubic"):
            raise ValueError(f"HunyuanVisionConfig.interpolate_mode={self.interpolate_mode!r}; expected "
                             f"'bilinear' or 'bicubic'")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """transformers' HunYuanVLConfig sets the merger's width to text_config.hidden_size when there is one."""
        width = language_width(config)
        return {} if width is None else {"out_hidden_size": width}

    @property
    def position_side(self) -> int:
        return self.max_image_size // self.patch_size


class HunyuanPerceive(nn.Module):
    """The merger. forward(x [T, hidden] merge-block order, out_index int64 [N_out]) -> [N_out, out_hidden]:
    row i of the output is merged row out_index[i], or (index N, N+1, N+2 with N merged rows) the
    newline, begin or end row."""

    def __init__(self, config: HunyuanVisionConfig, device=None, dtype=None):
        super().__init__()
        dim, out, eps, m = config.hidden_size, config.out_hidden_size, config.rms_norm_eps, config.spatial_merge_size
        self.before_rms = RMSNorm(dim, eps, device=device, dtype=dtype)
        self.proj_conv = ConvDownsample(dim, 2 * dim, m, prefix="perceive.proj_conv", device=device, dtype=dtype)
        self.act = get_act_fn(config.hidden_act)
        self.proj_out = ConvDownsample(2 * dim, 4 * dim, 1, prefix="perceive.proj_out", device=device, dtype=dtype)
        self.mlp = ReplicatedLinear(4 * dim, out, prefix="perceive.mlp", device=device, dtype=dtype)
        for name, width in (("image_newline", 4 * dim), ("image_begin", out), ("image_end", out), ("image_sep", out)):
            setattr(self, name, nn.Parameter(torch.empty(width, device=device, dtype=dtype), requires_grad=False))
        self.after_rms = RMSNorm(out, eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, out_index: torch.Tensor) -> torch.Tensor:
        x = self.proj_out(self.act(self.proj_conv(self.before_rms(x))))  # [N, 4 hidden]
        x = self.mlp(torch.cat([x, self.image_newline.to(x.dtype)[None]]))  # [N + 1, out]
        rows = torch.cat([x, self.image_begin.to(x.dtype)[None], self.image_end.to(x.dtype)[None]])
        return self.after_rms(rows[out_index])


@dataclasses.dataclass
class HunyuanPlan:
    """Device tensors a forward derives from grid_thw (cached per grid)."""

    num_patches: int
    cu_seqlens: torch.Tensor  # int32, one segment per frame
    max_seqlen: int
    token_order: torch.Tensor  # int64 [T]: raster pixel rows -> merge-block order
    pos_index: torch.Tensor  # int64 [T, taps] into the position table
    pos_weight: torch.Tensor  # float32 [T, taps]
    out_index: torch.Tensor  # int64 [N_out], see HunyuanPerceive


def output_layout(grid: Grid, merge_size: int) -> torch.Tensor:
    """Host int64 [N_out]: per frame, begin, then each row of merged tokens followed by the newline, then end."""
    merged = sum(t * h * w for t, h, w in grid) // merge_size ** 2
    newline, begin, end = merged, merged + 1, merged + 2
    parts, offset = [], 0
    for t, h, w in grid:
        hb, wb = h // merge_size, w // merge_size
        for _ in range(t):
            body = torch.arange(offset, offset + hb * wb).view(hb, wb)
            body = torch.cat([body, torch.full((hb, 1), newline)], dim=1).reshape(-1)
            parts += [torch.tensor([begin]), body, torch.tensor([end])]
            offset += hb * wb
    return torch.cat(parts)


class HunyuanVisionTower(VisionTower):
    """forward(pixel_values [T, C*p*p], rows in the processor's raster order per image; grid_thw int64
    [N, 3] on CPU) -> TowerOutput with embeddings [sum t * ((h/m) * (w/m + 1) + 2), out_hidden_size]."""

    # published names (save_pretrained writes them) and transformers' module names
    weight_map = WeightMap([
        ("embeddings.patch_embedding.", "embeddings.patch_embedding.proj.", None),
        (".input_layernorm.", ".norm1.", None),
        (".layer_norm1.", ".norm1.", None),
        (".post_attention_layernorm.", ".norm2.", None),
        (".layer_norm2.", ".norm2.", None),
        (".self_attn.q_proj.", ".attn.qkv.", "q"),
        (".self_attn.k_proj.", ".attn.qkv.", "k"),
        (".self_attn.v_proj.", ".attn.qkv.", "v"),
        (".self_attn.o_proj.", ".attn.proj.", None),
        (".mlp.dense_h_to_4h.", ".mlp.fc1.", None),
        (".mlp.dense_4h_to_h.", ".mlp.fc2.", None),
        ("perceive.proj.0.", "perceive.proj_conv.", None),
        ("perceive.proj.2.", "perceive.proj_out.", None),
        ("patch_merger.", "perceive.", None),
    ])
    plan_cache_size = 32

    def __init__(self, config: HunyuanVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.embeddings = nn.Module()
        self.embeddings.patch_embedding = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.embeddings.position_embedding = InterpolatedPosEmbed(
            config.position_side ** 2, dim, mode=config.interpolate_mode, align_corners=False,
            merge_size=self.merge, leading_rows=1, **dd)
        # MLP row blocks of 512 MiB, not the default 1.5 GiB: compiled + CUDA graphs on 8 pages (H200, run
        # 14a) the peak with the graph pool went from 3.14 to 2.79 GiB (transformers: 3.00) for 0.9% more time.
        self.layers = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.rms_norm_eps,
                        mlp="plain", act=config.hidden_act,
                        max_intermediate_bytes=LOW_INTERMEDIATE_BYTES, prefix=f"layers.{i}", **dd)
            for i in range(config.depth)])
        self.perceive = HunyuanPerceive(config, **dd)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """t * ((h/m) * (w/m + 1) + 2) per grid row: a newline after each merged row, begin and end."""
        m = self.merge
        return [t * ((h // m) * (w // m + 1) + 2) for t, h, w in self.read_grid(grid_thw)]

    def make_plan(self, grid: Grid, device) -> HunyuanPlan:
        cu, max_len = make_cu_seqlens(frame_lengths(grid), device)
        index, weight = self.embeddings.position_embedding.taps(grid, device)
        return HunyuanPlan(num_patches(grid), cu, max_len, to_device(merge_block_order(grid, self.merge), device),
                           index, weight, to_device(output_layout(grid, self.merge), device))

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        emb = self.embeddings
        x = emb.patch_embedding(pixel_values.reshape(plan.num_patches, -1)[plan.token_order])
        x = x + emb.position_embedding(plan.pos_index, plan.pos_weight).to(x.dtype)  # [T, hidden]
        for layer in self.layers:
            x = layer(x, plan.cu_seqlens, plan.max_seqlen)
        return TowerOutput(self.perceive(x, plan.out_index))


# tencent/HunyuanOCR (1B): transformers' HunYuanVLVisionConfig defaults are its vision sizes (SigLIP-style,
# 27 x 1152, patch 16, 2048 px position grid); its 0.5B Hunyuan language model is 1024 wide.
_HUNYUAN_OCR_VISION = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
                       "num_attention_heads": 16, "num_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
                       "max_image_size": 2048, "hidden_act": "gelu", "rms_norm_eps": 1e-5,
                       "interpolate_mode": "bilinear", "text_hidden_size": 1024, "out_hidden_size": 1024}

HUNYUAN_VL_SPEC = register_model(ModelSpec(
    architectures=("HunYuanVLForConditionalGeneration",),
    tower_cls=HunyuanVisionTower,
    config_from_hf=HunyuanVisionConfig.from_hf,
    weight_prefixes=("vit.", "model.vision_tower."),
    processor_from_hf=processor_for("hunyuan_vl"),
    builtin_configs={"tencent/HunyuanOCR": builtin_config("HunYuanVLForConditionalGeneration", "hunyuan_vl",
                                                          _HUNYUAN_OCR_VISION, text_config={"hidden_size": 1024})},
))
