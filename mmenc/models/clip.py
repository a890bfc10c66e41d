"""CLIP image towers (OpenAI CLIP and OpenCLIP models in the Hugging Face layout): `CLIPModel`,
`CLIPVisionModel`, `CLIPVisionModelWithProjection`.

Per frame of h x w patches the tower is mmenc.layers.vit.ViTEncoder with CLIP's settings: patch
convolution without bias, a class token, learned positions (resampled bicubically where a frame is not
the trained size: transformers' interpolate_pos_encoding=True), pre-LayerNorm, LayerNorm blocks with
quick_gelu (OpenAI) or gelu (some OpenCLIP conversions).
Embeddings: transformers' last_hidden_state, every token: [t * (1 + h*w), hidden] per grid row, each
frame's class token first, then its patches in raster order.
`pool(embeddings, grid_thw)`: the image embedding of an image-text model, one row per frame:
post_layernorm(class token), then visual_projection where the checkpoint has it (CLIPModel,
CLIPVisionModelWithProjection: transformers' get_image_features / image_embeds, [frames, projection_dim];
CLIPVisionModel: its pooler_output, [frames, hidden]).
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.vit import ViTEncoder, ViTPlan, check_vit_config, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device


@dataclasses.dataclass(frozen=True)
class ClipVisionConfig(TowerConfigBase):
    """CLIP's vision_config (defaults: transformers' CLIPVisionConfig, ViT-B/32 at 224 px).

    projection_dim: visual_projection's width (CLIPModel: the top-level projection_dim;
    CLIPVisionModelWithProjection: vision_config's); 0: none (CLIPVisionModel).
    """

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "projection_dim": (), "spatial_merge_size": ()}
    depth: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 32
    image_size: int = 224
    layer_norm_eps: float = 1e-5
    projection_dim: int = 0
    spatial_merge_size: int = 1

    def __post_init__(self):
        check_vit_config(self)
        if not isinstance(self.projection_dim, int) or self.projection_dim < 0:
            raise ValueError(f"ClipVisionConfig.projection_dim={self.projection_dim!r}; expected a width >= 0 "
                             f"(0: no visual_projection)")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        archs = config.get("architectures") or []
        if "CLIPModel" in archs:
            return {"projection_dim": int(config.get("projection_dim") or vision.get("projection_dim") or 512)}
        if "CLIPVisionModelWithProjection" in archs:
            return {"projection_dim": int(vision.get("projection_dim") or config.get("projection_dim") or 512)}
        return {"projection_dim": 0}

    def processor_defaults(self) -> dict[str, Any]:
        """OpenAI's CLIP preprocessing at the tower's size: shortest edge to image_size, centre crop."""
        return {"patch_size": self.patch_size, "size": {"shortest_edge": self.image_size},
                "crop_size": {"height": self.image_size, "width": self.image_size}}

    @property
    def temporal_patch_size(self) -> int:
        return 1


class ClipVisionTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each frame's patches in raster order), grid_thw int64 [N, 3] on
    CPU) -> TowerOutput with embeddings [sum t * (1 + h*w), hidden] (see the module docstring)."""

    weight_map = WeightMap([*vit_weight_rules("encoder."), ("projection.", "visual_projection.", None)])

    def __init__(self, config: ClipVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.encoder = ViTEncoder(dim=dim, num_heads=config.num_heads, mlp_hidden=config.intermediate_size,
                                  depth=config.depth, act=config.hidden_act, norm_eps=config.layer_norm_eps,
                                  patch_features=config.patch_features,
                                  position_side=config.image_size // config.patch_size, patch_bias=False,
                                  class_token=True, pre_norm=True, **dd)
        self.post_layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.visual_projection = (ReplicatedLinear(dim, config.projection_dim, bias=False, prefix="visual_projection",
                                                   **dd) if config.projection_dim else None)

    @property
    def pooled_width(self) -> int:
        """The width of `pool`'s vectors: projection_dim, or hidden_size without a visual_projection."""
        return self.config.projection_dim or self.config.hidden_size

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return [t * (1 + h * w) for t, h, w in self.read_grid(grid_thw)]

    def make_plan(self, grid: Grid, device) -> ViTPlan:
        return self.encoder.make_plan(grid, device)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        depth = self.config.depth
        last = self.encoder(pixel_values, plan, keep=(depth,))[depth]
        return TowerOutput(self.encoder.tokens(last, plan, drop_first=False))

    def pool(self, embeddings: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The image embedding per frame: embeddings [sum t * (1 + h*w), hidden] (this tower's output for
        grid_thw) -> [frames, projection_dim] (or [frames, hidden] without a projection)."""
        lengths = [1 + h * w for t, h, w in self.read_grid(grid_thw) for _ in range(t)]
        if embeddings.shape[0] != sum(lengths):
            raise ValueError(f"embeddings has {embeddings.shape[0]} rows but grid_thw describes {sum(lengths)} "
                             f"tokens (class token + patches per frame); pass the tower's output for this grid_thw")
        if not lengths:
            return embeddings.new_zeros(0, self.pooled_width)
        starts = to_device(torch.tensor([0, *lengths[:-1]]).cumsum(0), embeddings.device)  # no host wait (CUDA)
        pooled = self.post_layernorm(embeddings[starts])  # [frames, hidden]
        return self.visual_projection(pooled) if self.visual_projection is not None else pooled


# Published sizes (openai/clip-vit-* config.json: vision_config, projection_dim). ViT-B/16 and ViT-L/14
# at 224 px, ViT-L/14 at 336 px (LLaVA-1.5's tower).
_B16 = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "patch_size": 16, "image_size": 224, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
_L14 = {**_B16, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24, "num_attention_heads": 16,
        "patch_size": 14}
_L14_336 = {**_L14, "image_size": 336}


def _clip(vision: dict[str, Any], projection_dim: int, text_hidden: int) -> dict[str, Any]:
    return builtin_config("CLIPModel", "clip", {"model_type": "clip_vision_model", "projection_dim": projection_dim,
                                                **vision},
                          projection_dim=projection_dim, text_config={"hidden_size": text_hidden})


CLIP_SPEC = register_model(ModelSpec(
    architectures=("CLIPModel", "CLIPVisionModel", "CLIPVisionModelWithProjection"),
    tower_cls=ClipVisionTower,
    config_from_hf=ClipVisionConfig.from_hf,
    # CLIPModel / ...WithProjection: the tower and visual_projection side by side; CLIPVisionModel saved by
    # transformers < 5: vision_model.*; by transformers 5: the tower's names at the top level
    weight_prefixes=(("vision_model.", "visual_"), "vision_model.", ""),
    processor_from_hf=processor_for("clip"),
    builtin_configs={
        "openai/clip-vit-base-patch16": _clip(_B16, 512, 512),
        "openai/clip-vit-large-patch14": _clip(_L14, 768, 768),
        "openai/clip-vit-large-patch14-336": _clip(_L14_336, 768, 768),
    },
))
