"""LLaVA-1.5 (`LlavaForConditionalGeneration` with a CLIP or SigLIP tower) with its projector.

The tower is mmenc.layers.vit.ViTEncoder: CLIP (class token, pre-LayerNorm, quick_gelu) or SigLIP
(patch bias, gelu-tanh), as vision_config.model_type says; only the layers up to the deepest
`vision_feature_layer` are built (LLaVA-1.5 takes -2: the last layer is never run). Per frame:
  the hidden states of `vision_feature_layer` (an int, or a list whose states are concatenated along
  the features, in the listed order), transformers' `hidden_states` indexing (0: the embeddings);
  `vision_feature_select_strategy` "default" drops each frame's first token (CLIP's class token;
  under a SigLIP tower, as transformers does, its first patch), "full" keeps every token;
  the projector: linear_1 -> act -> linear_2.
Embeddings the language model consumes: transformers' get_image_features(...).pooler_output,
frames concatenated: [t * (h*w + class token - dropped), text hidden] per grid row.
Frames that are not the position table's size get it resampled bicubically (interpolate_pos_encoding);
LLaVA-1.5's processor always gives the trained size.
"""
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from mmenc.config import MultiModalConfig
from mmenc.layers.activation import get_act_fn
from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, map_rows
from mmenc.layers.vit import ViTPlan, check_vit_config, feature_index, tower_tensors, vit_encoder, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, lazy_processor
from mmenc.models.registry import register_model

# vision_config.model_type -> (tower kind, transformers' defaults for the keys a config.json may leave out)
VISION_TOWERS = {
    "clip_vision_model": ("clip", {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                   "num_attention_heads": 12, "patch_size": 32, "image_size": 224,
                                   "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}),
    "siglip_vision_model": ("siglip", {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                                       "num_attention_heads": 12, "patch_size": 16, "image_size": 224,
                                       "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}),
}
STRATEGIES = ("default", "full")


@dataclasses.dataclass(frozen=True)
class LlavaVisionConfig(TowerConfigBase):
    """The tower's vision_config plus LLaVA's feature selection and projector (top level of config.json).
    Defaults: LlavaConfig's (CLIP ViT-L/14-336, vision_feature_layer -2, "default", 4096-wide text).

    tower: "clip" or "siglip"; depth: the checkpoint tower's layers; feature_layers: hidden-state
    indices as the config gives them (negative from the end).
    """

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "tower": (), "feature_layers": (), "select": (),
                            "out_hidden_size": (), "projector_act": (), "projector_bias": (),
                            "spatial_merge_size": ()}
    tower: str = "clip"
    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "quick_gelu"
    in_channels: int = 3
    patch_size: int = 14
    image_size: int = 336
    layer_norm_eps: float = 1e-5
    feature_layers: tuple[int, ...] = (-2,)
    select: str = "default"
    out_hidden_size: int = 4096
    projector_act: str = "gelu"
    projector_bias: bool = True
    spatial_merge_size: int = 1

    def __post_init__(self):
        check_vit_config(self)
        if self.tower not in ("clip", "siglip"):
            raise ValueError(f"LlavaVisionConfig.tower={self.tower!r}; expected 'clip' or 'siglip'")
        if self.select not in STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy={self.select!r}; expected one of {STRATEGIES}")
        if not self.feature_layers:
            raise ValueError("vision_feature_layer=[]; expected a hidden-state index or a non-empty list of them")
        for layer in self.feature_layers:
            feature_index(layer, self.depth)
        self.check_positive("out_hidden_size")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        model_type = vision.get("model_type", "clip_vision_model")
        if model_type not in VISION_TOWERS:
            raise ValueError(f"vision_config.model_type={model_type!r}; mmenc serves "
                             f"{'/'.join(config.get('architectures') or ['LLaVA'])} with "
                             f"{', '.join(VISION_TOWERS)} (and pixtral) towers")
        tower, defaults = VISION_TOWERS[model_type]
        values: dict[str, Any] = {"tower": tower}
        for key, value in defaults.items():
            if vision.get(key) is None:
                values[{"num_hidden_layers": "depth", "num_attention_heads": "num_heads"}.get(key, key)] = value
        layer = config.get("vision_feature_layer", -2)
        values["feature_layers"] = tuple(layer) if isinstance(layer, (list, tuple)) else (layer,)
        values["select"] = config.get("vision_feature_select_strategy", "default")
        values["projector_act"] = config.get("projector_hidden_act", "gelu")
        values["projector_bias"] = bool(config.get("multimodal_projector_bias", True))
        text = config.get("text_config") or {}
        if text.get("hidden_size"):
            values["out_hidden_size"] = int(text["hidden_size"])
        return values

    def processor_defaults(self) -> dict[str, Any]:
        """The tower's own preprocessing at its size: CLIP's shortest edge + centre crop, SigLIP's fixed size."""
        side = {"height": self.image_size, "width": self.image_size}
        if self.tower == "siglip":
            return {"patch_size": self.patch_size, "size": side, "image_processor_type": "SiglipImageProcessor"}
        return {"patch_size": self.patch_size, "size": {"shortest_edge": self.image_size}, "crop_size": side}

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def class_token(self) -> bool:
        return self.tower == "clip"

    @property
    def feature_indices(self) -> tuple[int, ...]:
        """feature_layers as 0..depth indices, in the listed order."""
        return tuple(feature_index(layer, self.depth) for layer in self.feature_layers)


class LlavaTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each frame's patches in raster order), grid_thw int64 [N, 3] on
    CPU) -> TowerOutput with embeddings [sum t * tokens per frame, out_hidden_size] (module docstring)."""

    weight_map = WeightMap(vit_weight_rules("encoder."))
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: LlavaVisionConfig, multimodal_config: MultiModalConfig | None = None,
                 device=None, dtype=None):
        super().__init__(config, multimodal_config, device, dtype)
        dd, out = self.factory_kwargs, config.out_hidden_size
        self.layers_used = config.feature_indices
        self.encoder = vit_encoder(config, max(self.layers_used), multimodal_config, **dd)
        features = config.hidden_size * len(self.layers_used)
        self.linear_1 = ColumnParallelLinear(features, out, bias=config.projector_bias, prefix="linear_1", **dd)
        self.act = get_act_fn(config.projector_act)
        self.linear_2 = RowParallelLinear(out, out, bias=config.projector_bias, prefix="linear_2", **dd)
        self.max_intermediate_bytes = MAX_INTERMEDIATE_BYTES  # the projector's row blocks (mmenc.layers.row_blocks)

    @property
    def drop_first(self) -> bool:
        return self.config.select == "default"

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        per_frame = int(self.config.class_token) - int(self.drop_first)
        return [t * (h * w + per_frame) for t, h, w in self.read_grid(grid_thw)]

    def make_plan(self, grid: Grid, device) -> ViTPlan:
        return self.encoder.make_plan(grid, device)

    def features(self, pixel_values: torch.Tensor, plan: ViTPlan) -> torch.Tensor:
        """The selected hidden states, concatenated: [frames * tokens per frame, hidden * len(layers)]."""
        states = self.encoder(pixel_values, plan, keep=self.layers_used)
        parts = [self.encoder.tokens(states[i], plan, self.drop_first) for i in self.layers_used]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.features(pixel_values, plan)
        width = (self.linear_1.weight.shape[0] + 2 * self.config.out_hidden_size) * x.element_size()
        return TowerOutput(map_rows(self.project, x, width, self.max_intermediate_bytes))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The projector's MLP: x [rows, hidden * layers] -> [rows, out_hidden]."""
        return self.linear_2(self.act(self.linear_1(x)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(tower_tensors(weights, len(self.encoder.layers)))


# Published: llava-hf/llava-1.5-{7b,13b}-hf (CLIP ViT-L/14-336 under Vicuna 7B / 13B); the SigLIP
# so400m/14-384 tower of llava-hf/llava-interleave-qwen-{0.5b,7b}-hf (26 of its 27 layers, every token).
_CLIP_L14_336 = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                 "num_hidden_layers": 24, "num_attention_heads": 16, "patch_size": 14, "image_size": 336,
                 "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "projection_dim": 768}
_SIGLIP_SO400M_26 = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
                     "num_hidden_layers": 26, "num_attention_heads": 16, "patch_size": 14, "image_size": 384,
                     "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False}


def llava_builtin(vision: dict, text_hidden: int, layer: int, strategy: str, arch: str = "LlavaForConditionalGeneration",
                  model_type: str = "llava", **top) -> dict:
    return builtin_config(arch, model_type, vision, text_config={"hidden_size": text_hidden},
                          projector_hidden_act="gelu", multimodal_projector_bias=True, vision_feature_layer=layer,
                          vision_feature_select_strategy=strategy, **top)


# one group: tower and projector side by side (published checkpoints: vision_tower.vision_model.*, whose
# "vision_model." LlavaTower.load_weights drops; transformers 5 writes vision_tower.*)
LLAVA_WEIGHT_PREFIXES = (("model.vision_tower.", "model.multi_modal_projector."),
                         ("vision_tower.", "multi_modal_projector."))

LLAVA_SPEC = register_model(ModelSpec(
    architectures=("LlavaForConditionalGeneration",),
    vision_model_types=tuple(VISION_TOWERS),
    tower_cls=LlavaTower,
    config_from_hf=LlavaVisionConfig.from_hf,
    weight_prefixes=LLAVA_WEIGHT_PREFIXES,
    processor_from_hf=lazy_processor("mmenc.preprocess.clip:clip_from_hf"),
    builtin_configs={
        "llava-hf/llava-1.5-7b-hf": llava_builtin(_CLIP_L14_336, 4096, -2, "default"),
        "llava-hf/llava-1.5-13b-hf": llava_builtin(_CLIP_L14_336, 5120, -2, "default"),
        "llava-hf/llava-interleave-qwen-0.5b-hf": llava_builtin(_SIGLIP_SO400M_26, 896, -1, "full"),
        "llava-hf/llava-interleave-qwen-7b-hf": llava_builtin(_SIGLIP_SO400M_26, 3584, -1, "full"),
    },
))
