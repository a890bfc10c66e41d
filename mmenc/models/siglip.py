"""SigLIP and SigLIP2 (NaFlex) vision towers, with SigLIP's attention-pooling head.

One family, two checkpoints. Per frame of h x w patches (an image is one frame) the tower runs:
  patch embedding: SigLIP a Conv2d (patch rows in (C, p, p) order), SigLIP2 a Linear (rows in
  (p, p, C) order, as its processor writes them), both one matmul here;
  + learned positions: SigLIP's image_size/p square table, bicubically resampled when a frame is not
  that size (transformers' interpolate_pos_encoding=True); SigLIP2's 16x16 table resampled to every
  frame's (h, w) with antialiased bilinear weights (NaFlex);
  pre-norm LayerNorm blocks (fused qkv, gelu-tanh MLP) attending within the frame; post_layernorm.
Embeddings: post_layernorm's output, one row per patch ([sum t*h*w, hidden], transformers'
last_hidden_state on the valid tokens). PaliGemma and Gemma 3 (this tower with their projectors) are
models/paligemma.py.

Frames of one size run as a dense [B, S] batch; frames of different sizes (SigLIP2's NaFlex mix,
SigLIP at several resolutions) are packed into one varlen call (cu_seqlens), never padded.
`pool(embeddings, grid_thw)` is the attention-pooling head (`head`, standalone checkpoints): one probe
query attends over each frame's tokens, then LayerNorm + MLP with a residual -> [frames, hidden], the
image embedding of an image-embedding model (transformers' pooler_output).
"""
import dataclasses
import math
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.activation import get_act_fn
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import SIGLIP_ENCODER_RULES, WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class SiglipVisionConfig(TowerConfigBase):
    """SigLIP's vision_config. Defaults are transformers' SiglipVisionConfig defaults (base, 224 px).

    use_head: the checkpoint has the attention-pooling head (vision_use_head; standalone SigLIP).
    """

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "use_head": ("vision_use_head",),
                            "spatial_merge_size": ()}
    pos_mode: ClassVar[str] = "bicubic"  # how the position table is resampled to another frame size
    depth: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    image_size: int = 224
    layer_norm_eps: float = 1e-6
    use_head: bool = True
    spatial_merge_size: int = 1

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
                            "image_size", "spatial_merge_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"{type(self).__name__}: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}; expected a divisor")
        if self.image_size < self.patch_size:
            raise ValueError(f"{type(self).__name__}: image_size={self.image_size} is smaller than "
                             f"patch_size={self.patch_size}; expected at least one patch per side")

    def processor_defaults(self) -> dict[str, Any]:
        """SigLIP's preprocessor_config.json has neither: the patch size, and the image size the position
        table was trained at."""
        return {"patch_size": self.patch_size, "size": {"height": self.image_size, "width": self.image_size}}

    @property
    def temporal_patch_size(self) -> int:
        """Frames per pixel row: 1 (a grid row of t frames is t images)."""
        return 1

    @property
    def num_positions(self) -> int:
        """Learned positions: (image_size // patch_size)^2 (the convolution drops a partial last patch)."""
        return (self.image_size // self.patch_size) ** 2


@dataclasses.dataclass(frozen=True)
class Siglip2VisionConfig(SiglipVisionConfig):
    """SigLIP2's vision_config (NaFlex). Defaults are transformers' Siglip2VisionConfig defaults.

    num_patches: entries of the learned position table (a square, 256 = 16 x 16); image_size is unused.
    """

    hf_aliases: ClassVar = {**SiglipVisionConfig.hf_aliases, "image_size": ()}
    pos_mode: ClassVar[str] = "bilinear_antialias"
    num_patches: int = 256

    def __post_init__(self):
        super().__post_init__()
        if math.isqrt(self.num_patches) ** 2 != self.num_patches:
            raise ValueError(f"Siglip2VisionConfig.num_patches={self.num_patches} is not a square; expected "
                             f"side * side learned positions (e.g. 256)")

    def processor_defaults(self) -> dict[str, Any]:
        return {"patch_size": self.patch_size}

    @property
    def num_positions(self) -> int:
        return self.num_patches


# checkpoint name (tower prefix removed) -> parameter name; one rule applies per name
SIGLIP_WEIGHT_MAP = WeightMap([
    ("embeddings.patch_embedding.", "patch_embed.proj.", None),
    ("embeddings.position_embedding.", "pos_embed.", None),
    *SIGLIP_ENCODER_RULES,
    ("head.attention.in_proj_weight", "head.attention.in_proj.weight", None),
    ("head.attention.in_proj_bias", "head.attention.in_proj.bias", None),
])


class AttentionPoolingHead(nn.Module):
    """transformers' Siglip(2)MultiheadAttentionPoolingHead over packed frames; replicated (not sharded).

    forward(x [T, D], segment int64 [T] (frame of each token), frames) -> [frames, D]: the learned
    `probe` attends over each frame's tokens (nn.MultiheadAttention's in_proj / out_proj), then
    y + mlp(layernorm(y)). Softmax per frame in float32 by scatter (no padding, no mask).
    """

    def __init__(self, config: SiglipVisionConfig, device=None, dtype=None):
        super().__init__()
        dim, dd = config.hidden_size, {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.probe = nn.Parameter(torch.empty(1, 1, dim, **dd), requires_grad=False)
        self.attention = nn.Module()
        self.attention.in_proj = ReplicatedLinear(dim, 3 * dim, bias=True, prefix="head.attention.in_proj", **dd)
        self.attention.out_proj = ReplicatedLinear(dim, dim, bias=True, prefix="head.attention.out_proj", **dd)
        self.layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.mlp = nn.Module()
        self.mlp.fc1 = ReplicatedLinear(dim, config.intermediate_size, bias=True, prefix="head.mlp.fc1", **dd)
        self.mlp.act = get_act_fn(config.hidden_act)
        self.mlp.fc2 = ReplicatedLinear(config.intermediate_size, dim, bias=True, prefix="head.mlp.fc2", **dd)

    def forward(self, x: torch.Tensor, segment: torch.Tensor, frames: int) -> torch.Tensor:
        dim, heads, hd = x.shape[-1], self.num_heads, self.head_dim
        q = self.attention.in_proj(self.probe.reshape(1, dim))[:, :dim].float().view(heads, hd)
        kv = self.attention.in_proj(x)[:, dim:].float().view(-1, 2, heads, hd)  # [T, 3D] -> [T, 2, H, hd]
        scores = (kv[:, 0] * q).sum(-1) / math.sqrt(hd)  # [T, H]
        index = segment[:, None].expand_as(scores)
        peak = scores.new_full((frames, heads), -math.inf).scatter_reduce(0, index, scores, "amax")
        e = (scores - peak[segment]).exp()  # [T, H]
        den = scores.new_zeros(frames, heads).index_add_(0, segment, e)
        out = scores.new_zeros(frames, heads, hd).index_add_(0, segment, e[..., None] * kv[:, 1])
        y = self.attention.out_proj((out / den[..., None]).reshape(frames, dim).to(x.dtype))  # [F, D]
        return y + self.mlp.fc2(self.mlp.fc1.forward_activated(self.layernorm(y), self.mlp.act))


@dataclasses.dataclass
class SiglipPlan:
    """What a forward derives from grid_thw, once (device tensors, cached per grid).

    dense: every frame has `seq` patches (run as [batch, seq]); else packed by cu_seqlens.
    pos_index / pos_weight: taps into the position table (None: every frame is the table's size).
    segment: int64 [T], the frame of each token (for the pooling head).
    """

    num_patches: int
    frames: int
    dense: bool
    seq: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pos_index: torch.Tensor | None
    pos_weight: torch.Tensor | None
    segment: torch.Tensor


class SiglipVisionTower(VisionTower):
    """forward(pixel_values [T, C*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with embeddings
    [T, hidden_size] (patches of each frame in raster order), grid rows in order."""

    weight_map = SIGLIP_WEIGHT_MAP

    def __init__(self, config: SiglipVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.pos_embed = InterpolatedPosEmbed(config.num_positions, dim, mode=config.pos_mode, **dd)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.layer_norm_eps,
                        mlp="plain", act=config.hidden_act, prefix=f"encoder.layers.{i}", **dd)
            for i in range(config.depth)])
        self.post_layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.head = AttentionPoolingHead(config, **dd) if config.use_head else None

    def make_plan(self, grid: Grid, device) -> SiglipPlan:
        lengths = frame_lengths(grid)
        side = self.pos_embed.side
        native = all((h, w) == (side, side) for _, h, w in grid) and self.config.pos_mode == "bicubic"
        index, weight = (None, None) if native else self.pos_embed.taps(grid, device)
        cu, max_len = make_cu_seqlens(lengths, device)
        segment = to_device(torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths)), device)
        return SiglipPlan(num_patches(grid), len(lengths), len(set(lengths)) == 1, lengths[0], cu, max_len, index,
                          weight, segment)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values.reshape(plan.num_patches, -1))  # [T, D]
        if plan.pos_index is None:  # every frame at the table's size: add it as is
            x = (x.view(plan.frames, plan.seq, -1) + self.pos_embed.weight.to(x.dtype)).view_as(x)
        else:
            x = x + self.pos_embed(plan.pos_index, plan.pos_weight).to(x.dtype)
        if plan.dense:
            # [B, S, D] with the plan's uniform cu_seqlens (made once per grid): MMEncoderAttention's
            # cu_seqlens=None form builds them inside the call, which a fullgraph --compile cannot trace
            x = x.view(plan.frames, plan.seq, -1)
        for layer in self.encoder.layers:
            x = layer(x, plan.cu_seqlens, plan.max_seqlen)
        return TowerOutput(self.post_layernorm(x).reshape(plan.num_patches, -1))

    @property
    def pooled_width(self) -> int | None:
        """The width of `pool`'s vectors (hidden_size), or None without the pooling head (VLM checkpoints)."""
        return self.config.hidden_size if self.head is not None else None

    def pool(self, embeddings: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The attention-pooling head: embeddings [T, hidden] (this tower's output for grid_thw) ->
        [frames, hidden], one row per image (t rows for a grid row of t frames)."""
        if self.head is None:
            raise ValueError(f"this {type(self.config).__name__} checkpoint has no attention-pooling head "
                             f"(vision_use_head is false, as in VLM checkpoints); pooled embeddings need a "
                             f"standalone SigLIP/SigLIP2 checkpoint (SiglipModel, SiglipVisionModel, ...)")
        if grid_thw.shape[0] == 0:
            return embeddings.new_zeros(0, embeddings.shape[-1])
        plan = self.plan(grid_thw, embeddings.device)
        if embeddings.shape[0] != plan.num_patches:
            raise ValueError(f"embeddings has {embeddings.shape[0]} rows but grid_thw describes {plan.num_patches} "
                             f"patches; pass the tower's output for this grid_thw")
        return self.head(embeddings, plan.segment, plan.frames)


def _standalone(arch: str, model_type: str, vision: dict[str, Any]) -> dict[str, Any]:
    """A standalone SigLIP(2) config.json: published text towers are as wide as the vision tower."""
    return builtin_config(arch, model_type, {"vision_use_head": True, **vision},
                          text_config={"hidden_size": vision["hidden_size"]})


# Published sizes (vision_config of the google/siglip* config.json files; shapes from the SigLIP /
# SigLIP2 papers' B/16, L/16, So400m/14 and So400m/16 towers).
_BASE = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12}
_LARGE = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16}
_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16}

SIGLIP_SPEC = register_model(ModelSpec(
    architectures=("SiglipModel", "SiglipVisionModel"),
    tower_cls=SiglipVisionTower,
    config_from_hf=SiglipVisionConfig.from_hf,
    weight_prefixes=("vision_model.",),
    processor_from_hf=processor_for("siglip"),
    builtin_configs={
        "google/siglip-base-patch16-224": _standalone("SiglipModel", "siglip", {**_BASE, "patch_size": 16,
                                                                                "image_size": 224}),
        "google/siglip-large-patch16-384": _standalone("SiglipModel", "siglip", {**_LARGE, "patch_size": 16,
                                                                                 "image_size": 384}),
        "google/siglip-so400m-patch14-384": _standalone("SiglipModel", "siglip", {**_SO400M, "patch_size": 14,
                                                                                  "image_size": 384}),
    },
))

SIGLIP2_SPEC = register_model(ModelSpec(
    architectures=("Siglip2Model", "Siglip2VisionModel"),
    tower_cls=SiglipVisionTower,
    config_from_hf=Siglip2VisionConfig.from_hf,
    weight_prefixes=("vision_model.",),
    processor_from_hf=processor_for("siglip2"),
    builtin_configs={
        "google/siglip2-base-patch16-naflex": _standalone("Siglip2Model", "siglip2", {**_BASE, "patch_size": 16}),
        "google/siglip2-so400m-patch16-naflex": _standalone("Siglip2Model", "siglip2", {**_SO400M,
                                                                                        "patch_size": 16}),
    },
))
