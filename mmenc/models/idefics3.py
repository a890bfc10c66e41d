"""Idefics3 and SmolVLM / SmolVLM2 (`Idefics3ForConditionalGeneration`, `SmolVLMForConditionalGeneration`):
their SigLIP-style tower with NaViT positions, and the pixel-shuffle connector.

An image is its tiles (the processor's split into max_image_size squares, then the whole image resized to
one), one grid row (tiles, s, s); every tile is its own sequence. Per tile the tower is
mmenc.layers.vit.ViTEncoder: patch convolution with bias, positions by bucketed fractional coordinates
(Idefics3VisionEmbeddings; equal to the table for a tile of the trained size up to float32 rounding),
LayerNorm blocks (gelu-tanh) within the tile, post_layernorm.
The connector: pixel shuffle by scale_factor (each scale x scale block of patches concatenated, rows of
the block first) -> modality_projection.proj (no bias).
Embeddings the language model consumes: transformers' get_image_features(...).pooler_output:
[tiles * h*w / scale^2, text hidden] per image. transformers pads tiles of a batch to one size and masks the
padding (patch_attention_mask); mmenc packs tiles of different sizes without padding, and its processor
gives tiles of one size (so there is none to mask).
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.merge import merge_block_order
from mmenc.layers.norm import LayerNorm
from mmenc.layers.vit import ViTEncoder, ViTPlan, check_vit_config, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class Idefics3VisionConfig(TowerConfigBase):
    """Idefics3VisionConfig / SmolVLMVisionConfig plus the connector (top level: scale_factor, text_config).
    Defaults: transformers' (the so400m-style tower at 224 px / patch 32, scale_factor 2)."""

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "out_hidden_size": (), "spatial_merge_size": ()}
    depth: int = 12
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 3072
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 32
    image_size: int = 224
    layer_norm_eps: float = 1e-6
    out_hidden_size: int = 4096
    spatial_merge_size: int = 2

    def __post_init__(self):
        check_vit_config(self)
        self.check_positive("out_hidden_size", "spatial_merge_size")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        values = {"spatial_merge_size": int(config.get("scale_factor", 2))}
        text = config.get("text_config") or {}
        if text.get("hidden_size"):
            values["out_hidden_size"] = int(text["hidden_size"])
        return values

    def processor_defaults(self) -> dict[str, Any]:
        """The tile side and the tower's patch (the published preprocessor configs set the rest)."""
        return {"patch_size": self.patch_size, "max_image_size": {"longest_edge": self.image_size}}

    @property
    def temporal_patch_size(self) -> int:
        return 1


@dataclasses.dataclass
class Idefics3Plan:
    """The encoder's plan and `order` int64 [T]: the tokens in merge-block order (pixel shuffle = a reshape)."""

    vit: ViTPlan
    order: torch.Tensor

    @property
    def num_patches(self) -> int:
        return self.vit.num_patches


class Idefics3Tower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each tile's patches in raster order), grid_thw int64 [N, 3] = (tiles,
    h, w), h and w multiples of scale_factor) -> TowerOutput with embeddings [T / scale^2, out_hidden_size]."""

    weight_map = WeightMap([*vit_weight_rules("encoder."), ("modality_projection.proj.", "proj.", None)])
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: Idefics3VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.encoder = ViTEncoder(dim=dim, num_heads=config.num_heads, mlp_hidden=config.intermediate_size,
                                  depth=config.depth, act=config.hidden_act, norm_eps=config.layer_norm_eps,
                                  patch_features=config.patch_features,
                                  position_side=config.image_size // config.patch_size, patch_bias=True,
                                  class_token=False, pre_norm=False, positions="bucket", **dd)
        self.post_layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.proj = ReplicatedLinear(dim * self.merge ** 2, config.out_hidden_size, bias=False, prefix="proj", **dd)

    def make_plan(self, grid: Grid, device) -> Idefics3Plan:
        order = to_device(merge_block_order(grid, self.merge), device)
        return Idefics3Plan(self.encoder.make_plan(grid, device), order)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        depth = self.config.depth
        x = self.encoder(pixel_values, plan.vit, keep=(depth,))[depth]
        x = self.post_layernorm(self.encoder.tokens(x, plan.vit, drop_first=False))  # [T, D]
        x = x[plan.order].reshape(-1, self.merge ** 2 * x.shape[-1])  # pixel shuffle: [T / s^2, s^2 * D]
        return TowerOutput(self.proj(x))


# Published sizes (config.json; inferred from the releases, not checked against each file): Idefics3-8B (SigLIP
# so400m/14 at 364 px: 26 x 26 patches, scale 2, Llama 3 8B); SmolVLM-256M and SmolVLM2-256M / -500M (SigLIP
# base/16 at 512 px: 32 x 32, scale 4: 64 tokens a tile, SmolLM2-135M / -360M).
_SO400M = {"hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27, "num_attention_heads": 16,
           "patch_size": 14, "image_size": 364, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
_BASE_512 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
             "patch_size": 16, "image_size": 512, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}


def _builtin(smolvlm: bool, vision: dict, scale: int, text_hidden: int) -> dict:
    arch, model_type = (("SmolVLMForConditionalGeneration", "smolvlm") if smolvlm else
                        ("Idefics3ForConditionalGeneration", "idefics3"))
    return builtin_config(arch, model_type, {"model_type": f"{model_type}_vision", **vision}, scale_factor=scale,
                          text_config={"hidden_size": text_hidden})


IDEFICS3_SPEC = register_model(ModelSpec(
    architectures=("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
    tower_cls=Idefics3Tower,
    config_from_hf=Idefics3VisionConfig.from_hf,
    # one group: the vision model and the connector side by side
    weight_prefixes=(("model.vision_model.", "model.connector."), ("vision_model.", "connector.")),
    processor_from_hf=processor_for("idefics3"),
    builtin_configs={
        "HuggingFaceM4/Idefics3-8B-Llama3": _builtin(False, _SO400M, 2, 4096),
        "HuggingFaceTB/SmolVLM-256M-Instruct": _builtin(False, _BASE_512, 4, 576),
        "HuggingFaceTB/SmolVLM2-256M-Video-Instruct": _builtin(True, _BASE_512, 4, 576),
        "HuggingFaceTB/SmolVLM2-500M-Video-Instruct": _builtin(True, _BASE_512, 4, 960),
    },
))
