"""Pixtral vision tower (Pixtral-12B, Mistral Small 3.x) with its projector.

Per image (native resolution: h x w patches of any size), the tower runs:
  patch embedding (Conv2d without bias, as a matmul) -> RMSNorm (ln_pre);
  pre-norm RMSNorm blocks: q/k/v (no bias), 2-D rotary with Pixtral's axial frequencies (row: the even
  frequencies theta^(-2i/D), column: the odd ones), rotate-half layout; SwiGLU MLP (no bias);
  attention confined to the image (transformers: one block-diagonal mask over the padded batch; here:
  images packed into one varlen call, no padding, no mask);
  the projector of the checkpoint:
    Mistral3 (Mistral Small 3.x): RMSNorm -> 2x2 neighbours merged by a learned Linear (patch_merger)
      -> linear_1 -> GELU -> linear_2;
    Llava (Pixtral-12B): linear_1 -> GELU -> linear_2.
Embeddings the language model consumes: transformers' get_image_features(...).pooler_output
concatenated: [sum(h*w) / merge^2, text hidden]. A grid row (t, h, w) with t > 1 is t images of h x w.

Patches are permuted once, on input, from the processor's raster order to merge-block order (each
2x2 block contiguous), so the merge is a reshape; the rotary table is built in that order. The
checkpoint's patch_merger weight expects transformers' unfold order (channel-major), so its columns
are permuted once when loaded.
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.layers.activation import get_act_fn
from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from mmenc.layers.merge import merge_block_order
from mmenc.layers.norm import RMSNorm
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, map_rows
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device

PROJECTORS = ("mistral3", "llava")


@dataclasses.dataclass(frozen=True)
class PixtralVisionConfig(TowerConfigBase):
    """Pixtral's vision_config plus the projector's settings from the top level of config.json.
    Defaults are transformers' PixtralVisionConfig / Mistral3Config defaults.

    hidden_size: the tower's width; out_hidden_size: the language model's (text_config.hidden_size).
    projector: "mistral3" (norm + 2x2 patch merger; Mistral3ForConditionalGeneration) or "llava"
    (two linears; LlavaForConditionalGeneration with a pixtral vision_config).
    """

    hf_aliases: ClassVar = {
        "depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",), "in_channels": ("num_channels",),
        "out_hidden_size": (), "spatial_merge_size": (), "projector": (), "projector_bias": (),
        "projector_act": (), "projector_norm_eps": (),
    }
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu"
    in_channels: int = 3
    patch_size: int = 16
    image_size: int = 1024
    rope_theta: float = 10000.0
    out_hidden_size: int = 5120
    spatial_merge_size: int = 2
    projector: str = "mistral3"
    projector_bias: bool = False
    projector_act: str = "gelu"
    projector_norm_eps: float = 1e-5

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
                            "out_hidden_size", "spatial_merge_size")
        self.check_rotary_heads()
        if self.projector not in PROJECTORS:
            raise ValueError(f"PixtralVisionConfig.projector={self.projector!r}; expected one of {PROJECTORS}")
        if self.projector == "llava" and self.spatial_merge_size != 1:
            raise ValueError(f"PixtralVisionConfig: spatial_merge_size={self.spatial_merge_size} with the llava "
                             f"projector; Llava merges no patches, expected 1")

    @property
    def temporal_patch_size(self) -> int:
        return 1

    def processor_defaults(self) -> dict[str, Any]:
        """The processor class the published checkpoints name (sizes stay the processors' own defaults):
        transformers' processor for a `llava` config without a file would otherwise be LlavaImageProcessor."""
        return {"image_processor_type": "PixtralImageProcessor"}

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """The projector's kind and sizes from the top level and text_config; unsupported variants
        (another vision tower under Llava, features from another layer) raise ValueError."""
        if vision.get("model_type", "pixtral") != "pixtral":
            raise ValueError(f"vision_config.model_type={vision['model_type']!r}; mmenc serves "
                             f"{'/'.join(config.get('architectures') or ['this architecture'])} only with a Pixtral "
                             f"tower (vision_config.model_type 'pixtral')")
        text = config.get("text_config") or {}
        llava = config.get("model_type") == "llava" or "LlavaForConditionalGeneration" in (config.get("architectures")
                                                                                            or [])
        layer = config.get("vision_feature_layer", -1)
        if layer != -1:
            raise ValueError(f"vision_feature_layer={layer!r} is not supported; mmenc's Pixtral projects the last "
                             f"layer's output (-1)")
        strategy = config.get("vision_feature_select_strategy", "full" if not llava else "default")
        if llava and strategy != "full":
            raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported for Pixtral under "
                             f"Llava; expected 'full' (Pixtral has no CLS token to drop)")
        values = {"projector": "llava" if llava else "mistral3",
                  "spatial_merge_size": 1 if llava else int(config.get("spatial_merge_size", 2)),
                  "projector_bias": bool(config.get("multimodal_projector_bias", llava)),
                  "projector_act": config.get("projector_hidden_act", "gelu")}
        if text.get("hidden_size"):
            values["out_hidden_size"] = int(text["hidden_size"])
        if text.get("rms_norm_eps"):
            values["projector_norm_eps"] = float(text["rms_norm_eps"])
        if vision.get("rope_theta") is not None:
            values["rope_theta"] = float(vision["rope_theta"])
        return values


class MergingLayer(ReplicatedLinear):
    """Mistral3's patch_merger.merging_layer: [N, m*m*D] (block patches concatenated, raster order) ->
    [N, D], no bias. The checkpoint's weight [D, D*m*m] is in unfold order (channel-major: column
    c*m*m + k); it is loaded with columns rearranged to k*D + c."""

    def __init__(self, dim: int, merge_size: int, device=None, dtype=None):
        super().__init__(dim * merge_size ** 2, dim, bias=False, prefix="patch_merger.merging_layer", device=device,
                         dtype=dtype)
        self.dim, self.blocks = dim, merge_size ** 2
        self.weight.weight_loader = self._load_unfold_order

    def _load_unfold_order(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if tuple(loaded.shape) != tuple(param.shape):
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected {tuple(param.shape)}")
        param.data.copy_(loaded.view(self.dim, self.dim, self.blocks).transpose(1, 2).reshape(param.shape))


class PixtralVisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p] (each frame's patches in raster order), grid_thw
    int64 [N, 3] on CPU) -> TowerOutput with embeddings [T / merge^2, out_hidden_size], frames in order."""

    weight_map = WeightMap([
        ("patch_conv.", "patch_embed.proj.", None),
        (".attention_norm.", ".norm1.", None),
        (".ffn_norm.", ".norm2.", None),
        (".attention.q_proj.", ".attn.qkv.", "q"),
        (".attention.k_proj.", ".attn.qkv.", "k"),
        (".attention.v_proj.", ".attn.qkv.", "v"),
        (".attention.o_proj.", ".attn.proj.", None),
        (".feed_forward.gate_proj.", ".mlp.gate_up_proj.", 0),
        (".feed_forward.up_proj.", ".mlp.gate_up_proj.", 1),
        (".feed_forward.down_proj.", ".mlp.down_proj.", None),
    ])
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: PixtralVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, out, dd = config.hidden_size, config.out_hidden_size, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=False, **dd)
        self.ln_pre = RMSNorm(dim, 1e-5, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge, axis_freqs="alternate")
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="rms", norm_eps=1e-5, mlp="gated",
                        act=config.hidden_act, qkv_bias=False, mlp_bias=False, prefix=f"transformer.layers.{i}", **dd)
            for i in range(config.depth)])
        if config.projector == "mistral3":
            self.norm = RMSNorm(dim, config.projector_norm_eps, **dd)
            self.patch_merger = nn.Module()
            self.patch_merger.merging_layer = MergingLayer(dim, self.merge, **dd)
        self.linear_1 = ColumnParallelLinear(dim, out, bias=config.projector_bias, prefix="linear_1", **dd)
        self.act = get_act_fn(config.projector_act)
        self.linear_2 = RowParallelLinear(out, out, bias=config.projector_bias, prefix="linear_2", **dd)
        self.max_intermediate_bytes = MAX_INTERMEDIATE_BYTES  # the projector's row blocks (mmenc.layers.row_blocks)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        plan = frame_plan(grid, device, self.rotary)  # one segment per frame; rotary in merge-block order
        if self.merge > 1:
            plan.token_order = to_device(merge_block_order(grid, self.merge), device)
        return plan

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = pixel_values.reshape(plan.num_patches, -1)
        if plan.token_order is not None:
            x = x[plan.token_order]  # raster -> merge-block order
        x = self.ln_pre(self.patch_embed(x))  # [T, D]
        rotary = (plan.cos, plan.sin)
        for block in self.transformer.layers:
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
        if self.config.projector == "mistral3":
            x = self.patch_merger.merging_layer(self.norm(x).reshape(-1, self.merge ** 2 * x.shape[-1]))
        # the projector over row blocks past the budget (Pixtral-Large: 12,288 wide), each block's two alive at once
        # (linear_1's or the activation's, then linear_2's) and the rows of the output they are copied into
        width = (self.linear_1.weight.shape[0] + 2 * self.config.out_hidden_size) * x.element_size()
        return TowerOutput(map_rows(self.project, x, width, self.max_intermediate_bytes))  # [T / m^2, out_hidden]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The projector's MLP: x [rows, D] -> [rows, out_hidden]."""
        return self.linear_2(self.act(self.linear_1(x)))


# Published sizes (the checkpoints' config.json): Pixtral-12B (mistral-community/pixtral-12b, Llava
# format), Mistral-Small-3.1/3.2-24B (Mistral3). Pixtral-Large-Instruct-2411's tower: the 1664-wide,
# 32-layer encoder of its published params.json (vision_encoder), under a 12288-wide language model.
_PIXTRAL_12B = {"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
                "num_attention_heads": 16, "head_dim": 64, "patch_size": 16, "image_size": 1024,
                "hidden_act": "silu", "rope_theta": 10000.0}
_PIXTRAL_LARGE = {**_PIXTRAL_12B, "hidden_size": 1664, "intermediate_size": 8192, "num_hidden_layers": 32,
                  "head_dim": 104}
_MISTRAL_SMALL_31 = {**_PIXTRAL_12B, "patch_size": 14, "image_size": 1540}


def _llava(vision: dict, text_hidden: int) -> dict:
    return builtin_config("LlavaForConditionalGeneration", "llava", vision, text_config={"hidden_size": text_hidden},
                          projector_hidden_act="gelu", multimodal_projector_bias=True, vision_feature_layer=-1,
                          vision_feature_select_strategy="full")


def _mistral3(vision: dict, text_hidden: int) -> dict:
    return builtin_config("Mistral3ForConditionalGeneration", "mistral3", vision,
                          text_config={"hidden_size": text_hidden, "rms_norm_eps": 1e-5}, spatial_merge_size=2,
                          projector_hidden_act="gelu", multimodal_projector_bias=False, vision_feature_layer=-1)


_WEIGHT_PREFIXES = (("model.vision_tower.", "model.multi_modal_projector."), ("vision_tower.", "multi_modal_projector."))

# Two specs, one tower: the processors differ (Mistral3 resizes to multiples of patch * merge).
MISTRAL3_SPEC = register_model(ModelSpec(
    architectures=("Mistral3ForConditionalGeneration",),
    tower_cls=PixtralVisionTower,
    config_from_hf=PixtralVisionConfig.from_hf,
    # one group: tower and projector side by side (transformers >= 5 writes them under model.)
    weight_prefixes=_WEIGHT_PREFIXES,
    processor_from_hf=processor_for("mistral3"),
    builtin_configs={
        "mistralai/Mistral-Small-3.1-24B-Instruct-2503": _mistral3(_MISTRAL_SMALL_31, 5120),
        "mistralai/Mistral-Small-3.2-24B-Instruct-2506": _mistral3(_MISTRAL_SMALL_31, 5120),
    },
))

LLAVA_PIXTRAL_SPEC = register_model(ModelSpec(
    architectures=("LlavaForConditionalGeneration",),
    vision_model_types=("pixtral",),  # CLIP and SigLIP towers under Llava: mmenc.models.llava
    tower_cls=PixtralVisionTower,
    config_from_hf=PixtralVisionConfig.from_hf,
    weight_prefixes=_WEIGHT_PREFIXES,
    processor_from_hf=processor_for("pixtral"),
    builtin_configs={
        "mistralai/Pixtral-12B-2409": _llava(_PIXTRAL_12B, 5120),
        "mistralai/Pixtral-Large-Instruct-2411": _llava(_PIXTRAL_LARGE, 12288),
    },
))
