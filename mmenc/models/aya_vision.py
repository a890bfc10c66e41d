"""Aya Vision (`AyaVisionForConditionalGeneration`): a SigLIP tower and its pixel-shuffle SwiGLU projector.

An image is its tiles (GotOcr2ImageProcessor with crop_to_patches: the tiles, then a thumbnail), one grid
row (tiles, s, s); every tile is its own sequence. Per tile the tower is mmenc.layers.vit.ViTEncoder with
SigLIP's settings (patch bias, learned positions, gelu-tanh blocks), up to `vision_feature_layer` (-1:
every layer, before post_layernorm), every token ("full"). The projector: pixel shuffle by
downsample_factor (each 2 x 2 block of patches concatenated, rows of the block first) -> LayerNorm ->
linear_1 -> SwiGLU (the first half times silu of the second) -> linear_2.
Embeddings: transformers' get_image_features(...).pooler_output: [tiles * h*w / f^2, text hidden] per image.
The projector is replicated over tensor-parallel ranks (the tower's blocks shard).
"""
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.merge import merge_block_order
from mmenc.layers.norm import LayerNorm
from mmenc.layers.vit import ViTPlan, check_vit_config, feature_index, tower_tensors, vit_encoder, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class AyaVisionConfig(TowerConfigBase):
    """The SigLIP vision_config plus the projector (top level). Defaults: transformers' AyaVisionConfig."""

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "feature_layer": (), "out_hidden_size": (),
                            "alignment_size": (), "adapter_eps": (), "spatial_merge_size": ()}
    depth: int = 26
    hidden_size: int = 1152
    num_heads: int = 14
    intermediate_size: int = 4304
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 14
    image_size: int = 384
    layer_norm_eps: float = 1e-6
    feature_layer: int = -1
    out_hidden_size: int = 4096
    alignment_size: int = 4096
    adapter_eps: float = 1e-6
    spatial_merge_size: int = 2

    def __post_init__(self):
        check_vit_config(self)
        feature_index(self.feature_layer, self.depth)
        self.check_positive("out_hidden_size", "alignment_size", "spatial_merge_size")
        if self.alignment_size % 2:
            raise ValueError(f"alignment_intermediate_size={self.alignment_size} must be even (SwiGLU halves it)")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        layer = config.get("vision_feature_layer", -1)
        strategy = config.get("vision_feature_select_strategy", "full")
        model_type = vision.get("model_type", "siglip_vision_model")
        if not isinstance(layer, int) or strategy != "full" or model_type != "siglip_vision_model":
            raise ValueError(f"vision_feature_layer={layer!r}, vision_feature_select_strategy={strategy!r}, "
                             f"vision_config.model_type={vision.get('model_type')!r}: mmenc's Aya Vision takes one "
                             f"layer of a SigLIP tower, every token ('full'), as the published checkpoints do")
        text = config.get("text_config") or {}
        out = int(text.get("hidden_size", 4096))
        return {"feature_layer": layer, "out_hidden_size": out,
                "spatial_merge_size": int(config.get("downsample_factor", 2)),
                "alignment_size": int(config.get("alignment_intermediate_size") or out),
                "adapter_eps": float(config.get("adapter_layer_norm_eps", 1e-6))}

    def processor_defaults(self) -> dict[str, Any]:
        """GotOcr2ImageProcessor with crop_to_patches at the tower's tile size, mean/std 0.5."""
        return {"patch_size": self.patch_size, "size": {"height": self.image_size, "width": self.image_size},
                "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "max_patches": 12}

    @property
    def tower(self) -> str:
        return "siglip"

    @property
    def temporal_patch_size(self) -> int:
        return 1


@dataclasses.dataclass
class AyaVisionPlan:
    """The encoder's plan and `order` int64 [T]: the tokens in merge-block order (pixel shuffle = a reshape)."""

    vit: ViTPlan
    order: torch.Tensor

    @property
    def num_patches(self) -> int:
        return self.vit.num_patches


class AyaVisionTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each tile's patches in raster order), grid_thw int64 [N, 3] = (tiles,
    h, w), h and w multiples of downsample_factor) -> TowerOutput with embeddings [T / f^2, out_hidden_size]."""

    weight_map = WeightMap(vit_weight_rules("encoder."))
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: AyaVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dd, merged = self.factory_kwargs, config.hidden_size * self.merge ** 2
        self.layer = feature_index(config.feature_layer, config.depth)
        self.encoder = vit_encoder(config, self.layer, **dd)
        self.layernorm = LayerNorm(merged, config.adapter_eps, **dd)
        self.linear_1 = ReplicatedLinear(merged, config.alignment_size, bias=True, prefix="linear_1", **dd)
        self.linear_2 = ReplicatedLinear(config.alignment_size // 2, config.out_hidden_size, bias=True,
                                         prefix="linear_2", **dd)

    def make_plan(self, grid: Grid, device) -> AyaVisionPlan:
        order = to_device(merge_block_order(grid, self.merge), device)
        return AyaVisionPlan(self.encoder.make_plan(grid, device), order)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.encoder(pixel_values, plan.vit, keep=(self.layer,))[self.layer]
        x = self.encoder.tokens(x, plan.vit, drop_first=False)[plan.order]  # [T, D], merge-block order
        x, gate = self.linear_1(self.layernorm(x.reshape(-1, self.merge ** 2 * x.shape[-1]))).chunk(2, dim=-1)
        return TowerOutput(self.linear_2(F.silu(gate) * x))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(tower_tensors(weights, len(self.encoder.layers)))


# Published: CohereLabs/aya-vision-8b (SigLIP2-so400m/14 at 364 px: 26 x 26 patches, 169 tokens a tile, under
# Command R7B: 4096 wide). Sizes inferred from the release, not checked against its config.json.
_SO400M_364 = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
               "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "image_size": 364,
               "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False}

AYA_VISION_SPEC = register_model(ModelSpec(
    architectures=("AyaVisionForConditionalGeneration",),
    tower_cls=AyaVisionTower,
    config_from_hf=AyaVisionConfig.from_hf,
    weight_prefixes=(("model.vision_tower.", "model.multi_modal_projector."),
                     ("vision_tower.", "multi_modal_projector.")),
    processor_from_hf=processor_for("internvl"),  # GotOcr2ImageProcessor
    builtin_configs={
        "CohereLabs/aya-vision-8b": builtin_config(
            "AyaVisionForConditionalGeneration", "aya_vision", _SO400M_364, text_config={"hidden_size": 4096},
            downsample_factor=2, alignment_intermediate_size=28672, vision_feature_layer=-1,
            vision_feature_select_strategy="full"),
    },
))
