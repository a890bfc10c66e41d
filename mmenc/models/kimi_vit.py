"""Kimi MoonViT towers: Kimi-K2.5 (images and video chunks) and Kimi-VL (images), with their projector.

One family, two checkpoints. Per grid row (t, h, w) -- an image (t = 1) or a video chunk of t <= 4
frames -- the tower runs:
  patch embedding (Conv2d as a matmul, with bias) + a learned 64x64 position grid resampled bicubically
  to (h, w) + (K2.5, t > 1 only) a fixed sin/cos embedding of the frame index;
  pre-norm LayerNorm blocks: fused qkv, 2-D rotary in complex (interleaved) layout, column before row,
  gelu-tanh MLP; attention spans the whole grid row (all frames of a chunk);
  final LayerNorm; mean over the chunk's frames (temporal pooling, K2.5);
  the projector: LayerNorm per patch -> 2x2 neighbours concatenated -> Linear -> GELU -> Linear.

Embeddings the language model consumes: the projector's output, one row per 2x2 block of a frame
([h*w/4, text hidden] per grid row, whatever t). That is transformers' Kimi_K25Model.get_image_features
(mm_projector(vision_tower(...).pooler_output)) concatenated over rows, and Kimi-VL's
multi_modal_projector(vision_tower(...)).

Patches are permuted once, on input, from the processor's raster order to merge-block order (every
2x2 block contiguous), so the projector's merge is a reshape; rotary, position and pooling tables are
built in that order on the host, once per grid. Checkpoint names are the published (remote-code)
ones, which transformers' save_pretrained writes back too: vision_tower.patch_embed.*,
vision_tower.encoder.blocks.N.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}, vision_tower.encoder.final_layernorm,
and mm_projector.{pre_norm,proj.0,proj.2} (K2.5) or multi_modal_projector.{pre_norm,linear_1,linear_2}
(Kimi-VL). wqkv keeps the complex rotary layout, which is the one this tower applies.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, num_patches
from mmenc.layers.merge import merge_block_order
from mmenc.layers.norm import LayerNorm
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class KimiVisionConfig(TowerConfigBase):
    """MoonViT + projector. Defaults are Kimi-K2.5's published tower.

    hidden_size: the tower's width; out_hidden_size: the projector's output (the language model's width).
    pos_emb_time: frames a video chunk may have (K2.5: 4); 0 for an image-only tower (Kimi-VL).
    Reads transformers' Kimi_K25Config and the published remote-code config.json alike.
    """

    hf_aliases: ClassVar = {
        "depth": ("vt_num_hidden_layers", "num_hidden_layers"),
        "hidden_size": ("vt_hidden_size", "hidden_size"),
        "num_heads": ("vt_num_attention_heads", "num_attention_heads"),
        "intermediate_size": ("vt_intermediate_size", "intermediate_size"),
        "hidden_act": ("activation_func", "hidden_act"),
        "pos_emb_height": ("init_pos_emb_height", "pos_emb_height"),
        "pos_emb_width": ("init_pos_emb_width", "pos_emb_width"),
        "pos_emb_time": ("init_pos_emb_time", "pos_emb_time"),
        "in_channels": (), "norm_eps": (), "out_hidden_size": (), "spatial_merge_size": (),
        "projector_norm_eps": (),
    }

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 7168
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    projector_norm_eps: float = 1e-5

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "patch_size", "spatial_merge_size", "pos_emb_height", "pos_emb_width")
        if self.pos_emb_time < 0:
            raise ValueError(f"KimiVisionConfig.pos_emb_time={self.pos_emb_time} must be >= 0 (0: images only)")
        self.check_rotary_heads()
        if self.pos_emb_height != self.pos_emb_width:
            raise ValueError(f"KimiVisionConfig: pos_emb_height={self.pos_emb_height} != pos_emb_width="
                             f"{self.pos_emb_width}; only a square learned position grid is supported")

    @property
    def temporal_patch_size(self) -> int:
        """Frames per pixel row: 1 (a video chunk is a grid row of t frames, not a thicker patch)."""
        return 1

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """Computed, not read: the merge size from merge_kernel_size, the output width and the projector's
        eps from outside vision_config (text_config, top-level keys); variants this tower does not
        implement raise ValueError."""
        for key, value in _IMPLEMENTED.items():
            if key in vision and vision[key] != value:
                raise ValueError(f"vision_config.{key}={vision[key]!r} is not supported; mmenc's MoonViT implements "
                                 f"{key}={value!r}")
        hidden = int(_first(vision, *cls.hf_aliases["hidden_size"], default=cls.hidden_size))
        qkv = _first(vision, "qkv_hidden_size")
        if qkv is not None and int(qkv) != hidden:
            raise ValueError(f"vision_config.qkv_hidden_size={qkv} differs from the tower width {hidden}; not supported")
        projection = config.get("projection_hidden_size")
        if projection is not None and int(projection) != hidden:
            raise ValueError(f"projection_hidden_size={projection} differs from the tower width {hidden}; expected equal")
        merge = tuple(vision.get("merge_kernel_size") or (2, 2))
        if len(merge) != 2 or merge[0] != merge[1]:
            raise ValueError(f"vision_config.merge_kernel_size={list(merge)} is not supported; expected a square "
                             f"kernel")
        values = {"spatial_merge_size": int(merge[0])}
        out = _first(config.get("text_config") or {}, "hidden_size") or _first(vision, "text_hidden_size")
        if out:
            values["out_hidden_size"] = int(out)
        eps = _first(config, "projection_layer_norm_eps") or _first(vision, "projector_ln_eps")
        if eps:
            values["projector_norm_eps"] = float(eps)
        return values


@dataclasses.dataclass(frozen=True)
class KimiVLVisionConfig(KimiVisionConfig):
    """Kimi-VL's MoonViT (remote code: vision_config of model_type "moonvit"): images only, and a
    2048-wide language model unless the config says otherwise."""

    hf_aliases: ClassVar = {**KimiVisionConfig.hf_aliases, "pos_emb_time": ()}
    out_hidden_size: int = 2048
    pos_emb_time: int = 0


# Published variants this tower does not implement: key -> the value it implements.
_IMPLEMENTED = {"pos_emb_type": "divided_fixed", "merge_type": "sd2_tpool", "video_attn_type": "spatial_temporal",
                "mm_projector_type": "patchmerger", "norm_type": "layernorm", "mlp_type": "mlp2",
                "pos_emb_interpolation_mode": "bicubic", "projector_hidden_act": "gelu", "attn_bias": True,
                "linear_bias": True, "patch_embed_proj_bias": True}


def _first(d: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    return next((d[k] for k in keys if d.get(k) is not None), default)


# Checkpoint name (tower group prefix removed) -> parameter name. Block renames are substrings of
# "encoder.blocks.N.*"; one rule applies per name, so the fc0/fc1 and norm0/norm1 shifts are safe.
# transformers' save_pretrained writes the patch projection as encoder.patch_embed.proj.
_BLOCK_RULES = [
    ("encoder.patch_embed.", "patch_embed.", None),
    (".norm0.", ".norm1.", None),
    (".norm1.", ".norm2.", None),
    (".wqkv.", ".attn.qkv.", None),
    (".wo.", ".attn.proj.", None),
    (".mlp.fc0.", ".mlp.fc1.", None),
    (".mlp.fc1.", ".mlp.fc2.", None),
]
KIMI_K25_WEIGHT_MAP = WeightMap(_BLOCK_RULES + [
    ("pre_norm.", "merger.ln_q.", None),
    ("proj.0.", "merger.fc1.", None),
    ("proj.2.", "merger.fc2.", None),
])
KIMI_VL_WEIGHT_MAP = WeightMap(_BLOCK_RULES + [
    ("pre_norm.", "merger.ln_q.", None),
    ("linear_1.", "merger.fc1.", None),
    ("linear_2.", "merger.fc2.", None),
])


def frame_sincos(num_frames: int, dim: int) -> torch.Tensor:
    """float32 [num_frames + 1, dim]: row 0 zeros (single images), row f + 1 = [sin | cos](f * inv_freq)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    angles = torch.arange(num_frames, dtype=torch.float32)[:, None] * inv_freq  # [F, D/2]
    return torch.cat([torch.zeros(1, dim), torch.cat([angles.sin(), angles.cos()], dim=-1)])


class KimiPosEmbed(InterpolatedPosEmbed):
    """The learned position grid; loads the checkpoint's [H, W, dim] tensor into [H*W, dim]."""

    def __init__(self, side: int, dim: int, merge_size: int, device=None, dtype=None):
        super().__init__(side * side, dim, mode="bicubic", align_corners=False, merge_size=merge_size, device=device,
                         dtype=dtype)
        self.weight.weight_loader = self._load_grid

    def _load_grid(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.numel() != param.numel() or loaded.shape[-1] != param.shape[-1]:
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected [{self.side}, {self.side}, "
                             f"{param.shape[-1]}]")
        param.data.copy_(loaded.reshape(param.shape))


class KimiPatchEmbed(PatchEmbed):
    """Conv2d patch projection (with bias) plus `pos_emb`, the learned position grid."""

    def __init__(self, config: KimiVisionConfig, device=None, dtype=None):
        super().__init__(config.patch_features, config.hidden_size, bias=True, device=device, dtype=dtype)
        self.pos_emb = KimiPosEmbed(config.pos_emb_height, config.hidden_size, config.spatial_merge_size,
                                    device=device, dtype=dtype)


@dataclasses.dataclass
class KimiPlan:
    """What a forward derives from grid_thw, once (device tensors, cached per grid)."""

    num_patches: int
    order: torch.Tensor  # int64 [T]: tower row i is pixel row order[i] (raster -> merge-block order)
    cu_seqlens: torch.Tensor  # int32, one segment per grid row (t*h*w)
    max_seqlen: int
    cos: torch.Tensor
    sin: torch.Tensor
    pos_index: torch.Tensor  # int64 [T, 16] bicubic taps into the position grid
    pos_weight: torch.Tensor  # float32 [T, 16]
    frame_index: torch.Tensor | None  # int64 [T] rows of frame_sincos; None when every t == 1
    pool_index: torch.Tensor | None  # int64 [T] pooled row of each patch; None when every t == 1
    pool_weight: torch.Tensor | None  # float32 [T] 1 / t
    pooled_rows: int  # sum(h * w)


class KimiVisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p] (rows in the processor's raster order per frame),
    grid_thw int64 [N, 3] on CPU) -> TowerOutput with embeddings [sum(h*w) / merge^2, out_hidden_size],
    grid rows in order."""

    weight_map = KIMI_K25_WEIGHT_MAP
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: KimiVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.patch_embed = KimiPatchEmbed(config, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge, interleaved=True,
                                     col_first=True)
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.norm_eps,
                        mlp="plain", act=config.hidden_act, rotary_interleaved=True, prefix=f"encoder.blocks.{i}", **dd)
            for i in range(config.depth)])
        self.encoder.final_layernorm = LayerNorm(dim, config.norm_eps, **dd)
        self.merger = PatchMerger(config.out_hidden_size, dim, self.merge, norm="layer",
                                  norm_eps=config.projector_norm_eps, act="gelu", **dd)
        self.register_buffer("frame_table", frame_sincos(config.pos_emb_time, dim).to(device), persistent=False)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """h * w / merge^2 per grid row: a video chunk's frames are pooled into one."""
        return [h * w // self.merge ** 2 for _, h, w in self.read_grid(grid_thw)]

    def read_grid(self, grid_thw: torch.Tensor) -> Grid:
        grid = super().read_grid(grid_thw)
        limit = max(self.config.pos_emb_time, 1)
        for i, (t, h, w) in enumerate(grid):
            if t > limit:
                what = "video chunks of" if self.config.pos_emb_time else "images only, t ="
                raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: t={t} frames; this tower takes {what} at most "
                                 f"{limit} frame(s) per grid row (split longer videos into chunks)")
        return grid

    def make_plan(self, grid: Grid, device) -> KimiPlan:
        frames, pool, weights, pooled = [], [], [], 0
        for t, h, w in grid:
            frames.append(torch.arange(t).repeat_interleave(h * w) + int(t > 1))
            pool.append(torch.arange(h * w).repeat(t) + pooled)
            weights.append(torch.full((t * h * w,), 1.0 / t))
            pooled += h * w
        cu, max_len = make_cu_seqlens([t * h * w for t, h, w in grid], device)
        cos, sin = self.rotary.tables(grid, device)
        pos_index, pos_weight = self.patch_embed.pos_emb.taps(grid, device)
        video = any(t > 1 for t, _, _ in grid)
        to = (lambda parts: to_device(torch.cat(parts), device)) if video else (lambda parts: None)
        order = to_device(merge_block_order(grid, self.merge), device)  # raster -> merge-block order
        return KimiPlan(num_patches(grid), order, cu, max_len, cos, sin, pos_index, pos_weight,
                        to(frames), to(pool), to(weights), pooled)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values.reshape(plan.num_patches, -1)[plan.order])  # [T, D], merge-block order
        pos = self.patch_embed.pos_emb(plan.pos_index, plan.pos_weight)  # float32 [T, D]
        if plan.frame_index is not None:
            pos = pos + self.frame_table[plan.frame_index]
        x = x + pos.to(x.dtype)
        rotary = (plan.cos, plan.sin)
        for block in self.encoder.blocks:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        x = self.encoder.final_layernorm(x)
        if plan.pool_index is not None:  # mean over each chunk's frames, accumulated in float32
            pooled = x.new_zeros(plan.pooled_rows, x.shape[-1], dtype=torch.float32)
            x = pooled.index_add_(0, plan.pool_index, x.float() * plan.pool_weight[:, None]).to(x.dtype)
        return TowerOutput(self.merger(x))  # [sum(h*w) / m^2, out_hidden]


class KimiVLVisionTower(KimiVisionTower):
    """Kimi-VL's MoonViT: the K2.5 tower without video, its projector named multi_modal_projector."""

    weight_map = KIMI_VL_WEIGHT_MAP


def kimi_vl_processor(preprocessor_config: Mapping[str, Any]):
    """Kimi-VL's image processor is remote code (PIL resize under an `in_token_limit` patch budget, its
    own mean/std defaults) and has no mmenc counterpart yet; raises ValueError saying what to do."""
    raise ValueError("Kimi-VL's image processor (remote code KimiVLImageProcessor) is not implemented in mmenc; "
                     "preprocess with the checkpoint's own processor and call encode_pixels(pixel_values, grid_thw) "
                     "with grid_thw rows [1, h, w] (its image_grid_hws with t = 1 prepended)")


_K25_VISION = {"patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
               "pos_emb_type": "divided_fixed", "vt_hidden_size": 1152, "vt_num_hidden_layers": 27,
               "vt_num_attention_heads": 16, "vt_intermediate_size": 4304, "merge_kernel_size": [2, 2],
               "video_attn_type": "spatial_temporal", "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger",
               "mm_hidden_size": 1152, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5,
               "text_hidden_size": 7168}
_KIMI_VL_VISION = {"model_type": "moonvit", "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64,
                   "num_attention_heads": 16, "num_hidden_layers": 27, "hidden_size": 1152,
                   "intermediate_size": 4304, "merge_kernel_size": [2, 2]}


def _builtin(arch: str, model_type: str, vision: dict[str, Any], text_hidden: int) -> dict[str, Any]:
    return builtin_config(arch, model_type, vision, text_config={"hidden_size": text_hidden})


KIMI_K25_SPEC = register_model(ModelSpec(
    architectures=("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"),
    tower_cls=KimiVisionTower,
    config_from_hf=KimiVisionConfig.from_hf,
    # one group: the tower and its projector sit side by side; transformers' save_pretrained writes the
    # projector's norm as model.mm_projector.pre_norm
    weight_prefixes=(("vision_tower.", "mm_projector.", "model.mm_projector."),),
    processor_from_hf=processor_for("kimi_k25"),
    builtin_configs={"moonshotai/Kimi-K2.5": _builtin("KimiK25ForConditionalGeneration", "kimi_k25", _K25_VISION,
                                                      7168)},
))

KIMI_VL_SPEC = register_model(ModelSpec(
    architectures=("KimiVLForConditionalGeneration",),
    tower_cls=KimiVLVisionTower,
    config_from_hf=KimiVLVisionConfig.from_hf,
    weight_prefixes=(("vision_tower.", "multi_modal_projector."),),
    processor_from_hf=kimi_vl_processor,
    builtin_configs={name: _builtin("KimiVLForConditionalGeneration", "kimi_vl", _KIMI_VL_VISION, 2048)
                     for name in ("moonshotai/Kimi-VL-A3B-Instruct", "moonshotai/Kimi-VL-A3B-Thinking")},
))
