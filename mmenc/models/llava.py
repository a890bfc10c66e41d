"""The LLaVA family with its projector: LLaVA-1.5 (`LlavaForConditionalGeneration` with a CLIP or SigLIP
tower), LLaVA-NeXT (`LlavaNextForConditionalGeneration`) and LLaVA-OneVision
(`LlavaOnevisionForConditionalGeneration`), which add anyres tiling; VipLlava (`VipLlavaForConditionalGeneration`:
five layers of LLaVA-1.5's tower, class tokens dropped, a LayerNorm before the projector).

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
Anyres (NeXT, OneVision): an image is a grid row (tiles, s, s, H, W): the base tile and the canvas's tiles
(mmenc.preprocess.anyres), (H, W) its size in pixels (transformers' image_sizes). The tiles run as one
dense batch; after the projector, the features are packed as transformers' pack_image_features does
(mmenc.layers.anyres: base tile, the unpadded canvas rows, OneVision's anyres_max shrink, image_newline
after each row) by one gather over the projected rows [tokens, text hidden]. A three-column row (t, h, w)
is t untiled images (OneVision's multi-image form): each one's tokens and a newline.
"""
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.utils.device_copy import to_device

from mmenc.layers.activation import get_act_fn
from mmenc.layers.anyres import AnyresGeometry, pack_taps, packed_tokens
from mmenc.layers.grid import Grid
from mmenc.layers.linear import ColumnParallelLinear, RowParallelLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, map_rows
from mmenc.layers.vit import ViTPlan, check_vit_config, feature_index, tower_tensors, vit_encoder, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
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
# anyres families: config.json model_type -> (kind, vision_feature_layer, strategy, image_grid_pinpoints)
# defaults of LlavaNextConfig / LlavaOnevisionConfig
ANYRES = {
    "llava_next": ("next", -2, "default", ((336, 672), (672, 336), (672, 672), (1008, 336), (336, 1008))),
    "llava_onevision": ("onevision", -1, "full", tuple((384 * a, 384 * b) for a in range(1, 7) for b in range(1, 7))),
}
ANYRES_PROCESSORS = {"next": "LlavaNextImageProcessor", "onevision": "LlavaOnevisionImageProcessor"}


@dataclasses.dataclass(frozen=True)
class LlavaVisionConfig(TowerConfigBase):
    """The tower's vision_config plus LLaVA's feature selection and projector (top level of config.json).
    Defaults: LlavaConfig's (CLIP ViT-L/14-336, vision_feature_layer -2, "default", 4096-wide text).

    tower: "clip" or "siglip"; depth: the checkpoint tower's layers; feature_layers: hidden-state
    indices as the config gives them (negative from the end).
    anyres: "" (LLaVA-1.5), "next" or "onevision"; grid_pinpoints: the canvases (h, w) in pixels;
    max_tiles: OneVision's vision_aspect_ratio anyres_max_N.
    projector_norm_eps: > 0: a LayerNorm before linear_1 (VipLlava's projector_layernorm).
    """

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "tower": (), "feature_layers": (), "select": (),
                            "out_hidden_size": (), "projector_act": (), "projector_bias": (), "projector_norm_eps": (),
                            "spatial_merge_size": (), "anyres": (), "grid_pinpoints": (), "max_tiles": ()}
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
    projector_norm_eps: float = 0.0
    spatial_merge_size: int = 1
    anyres: str = ""
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    max_tiles: int = 0

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
        if self.anyres not in ("", "next", "onevision"):
            raise ValueError(f"LlavaVisionConfig.anyres={self.anyres!r}; expected '', 'next' or 'onevision'")
        if self.anyres and self.class_token != (self.select == "default"):
            raise ValueError(f"vision_feature_select_strategy={self.select!r} with a {self.tower} tower leaves "
                             f"{'one more' if self.class_token else 'one fewer'} token than a tile's patches; anyres "
                             f"packing (as transformers') needs 'default' for CLIP towers and 'full' for SigLIP")
        if self.anyres and (not self.grid_pinpoints or any(h % self.image_size or w % self.image_size
                                                           for h, w in self.grid_pinpoints)):
            raise ValueError(f"image_grid_pinpoints={[list(p) for p in self.grid_pinpoints]}; expected canvases "
                             f"[[h, w], ...] that are multiples of the tile size {self.image_size}")

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
        anyres, default_layer, default_select, pinpoints = ANYRES.get(config.get("model_type"), ("", -2, "default", ()))
        layer = config.get("vision_feature_layer", default_layer)
        values["feature_layers"] = tuple(layer) if isinstance(layer, (list, tuple)) else (layer,)
        values["select"] = config.get("vision_feature_select_strategy", default_select)
        if anyres:
            values["anyres"] = anyres
            values["grid_pinpoints"] = tuple((int(h), int(w)) for h, w in config.get("image_grid_pinpoints")
                                             or pinpoints)
        if anyres == "onevision":
            ratio = str(config.get("vision_aspect_ratio", "anyres_max_9"))
            if not ratio.startswith("anyres_max_") or not ratio.removeprefix("anyres_max_").isdigit():
                raise ValueError(f"vision_aspect_ratio={ratio!r}; expected 'anyres_max_N' (e.g. anyres_max_9)")
            values["max_tiles"] = int(ratio.removeprefix("anyres_max_"))
        values["projector_act"] = config.get("projector_hidden_act", "gelu")
        values["projector_bias"] = bool(config.get("multimodal_projector_bias", True))
        if config.get("model_type") == "vipllava":  # VipLlava: CLS always dropped, a LayerNorm first
            # published VipLlava configs (and transformers before 5.24) spell it vision_feature_layers
            layer = config.get("vision_feature_layers", config.get("vision_feature_layer", (-2, -5, -8, -11, 6)))
            values["feature_layers"] = tuple(layer) if isinstance(layer, (list, tuple)) else (layer,)
            values["select"] = "default"
            values["projector_norm_eps"] = float(config.get("projector_layernorm_eps", 1e-5))
        text = config.get("text_config") or {}
        if text.get("hidden_size"):
            values["out_hidden_size"] = int(text["hidden_size"])
        return values

    def processor_defaults(self) -> dict[str, Any]:
        """The tower's own preprocessing at its size: CLIP's shortest edge + centre crop, SigLIP's fixed size."""
        side = {"height": self.image_size, "width": self.image_size}
        # the processor class the published checkpoints name (transformers' side of `mmenc bench --e2e` reads it)
        kind = ANYRES_PROCESSORS.get(self.anyres) or ("SiglipImageProcessor" if self.tower == "siglip" else
                                                      "CLIPImageProcessor")
        anyres = {"image_grid_pinpoints": [list(p) for p in self.grid_pinpoints]} if self.anyres else {}
        if self.tower == "siglip":
            return {"patch_size": self.patch_size, "size": side, "image_processor_type": kind,
                    "do_center_crop": False, "image_mean": [0.5] * 3, "image_std": [0.5] * 3, **anyres}
        return {"patch_size": self.patch_size, "size": {"shortest_edge": self.image_size}, "crop_size": side,
                "image_processor_type": kind, **anyres}

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def class_token(self) -> bool:
        return self.tower == "clip"

    @property
    def geometry(self) -> AnyresGeometry:
        """The anyres tiling this tower's features are packed by."""
        return AnyresGeometry(self.image_size // self.patch_size, self.image_size, self.grid_pinpoints, self.max_tiles)

    @property
    def feature_indices(self) -> tuple[int, ...]:
        """feature_layers as 0..depth indices, in the listed order."""
        return tuple(feature_index(layer, self.depth) for layer in self.feature_layers)


@dataclasses.dataclass
class LlavaPlan:
    """The encoder's plan for the tiles, and (anyres) the packing taps: pack_index int64 [out] (a gather) or
    [out, k] with pack_weight float32 [out, k] (OneVision's bilinear shrink); None for LLaVA-1.5."""

    vit: ViTPlan
    pack_index: torch.Tensor | None = None
    pack_weight: torch.Tensor | None = None

    @property
    def num_patches(self) -> int:
        return self.vit.num_patches


class LlavaTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each frame's patches in raster order), grid_thw int64 [N, 3] on
    CPU) -> TowerOutput with embeddings [sum t * tokens per frame, out_hidden_size] (module docstring)."""

    weight_map = WeightMap(vit_weight_rules("encoder."))
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: LlavaVisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dd, out = self.factory_kwargs, config.out_hidden_size
        self.layers_used = config.feature_indices
        self.encoder = vit_encoder(config, max(self.layers_used), **dd)
        features = config.hidden_size * len(self.layers_used)
        self.projector_layernorm = (LayerNorm(features, config.projector_norm_eps, **dd) if config.projector_norm_eps
                                    else None)
        self.linear_1 = ColumnParallelLinear(features, out, bias=config.projector_bias, prefix="linear_1", **dd)
        self.act = get_act_fn(config.projector_act)
        self.linear_2 = RowParallelLinear(out, out, bias=config.projector_bias, prefix="linear_2", **dd)
        self.max_intermediate_bytes = MAX_INTERMEDIATE_BYTES  # the projector's row blocks (mmenc.layers.row_blocks)
        if config.anyres:  # LlavaNextModel.image_newline: the checkpoint's "image_newline", read as "newline"
            self.newline = nn.Parameter(torch.empty(out, **dd), requires_grad=False)

    @property
    def drop_first(self) -> bool:
        return self.config.select == "default"

    def frame_tokens(self, h: int, w: int) -> int:
        """Tokens a frame (tile) of h x w patches yields before packing."""
        return h * w + int(self.config.class_token) - int(self.drop_first)

    def read_grid(self, grid_thw: torch.Tensor) -> Grid:
        """(t, h, w) rows, or for anyres towers also (tiles, s, s, H, W) rows (ValueError naming a bad row)."""
        if not self.config.anyres or grid_thw.dim() != 2 or grid_thw.shape[-1] != 5:
            return super().read_grid(grid_thw)
        grid = super().read_grid(grid_thw[:, :3])
        s, geometry = self.config.geometry.side, self.config.geometry
        rows = tuple((*row, int(h), int(w)) for row, (h, w) in zip(grid, grid_thw[:, 3:].tolist()))
        for i, (t, gh, gw, h, w) in enumerate(rows):
            expected = (1 + math.prod(geometry.canvas_tiles(h, w)), s, s, h, w) if min(h, w) > 0 else None
            if (t, gh, gw, h, w) != expected:
                raise ValueError(f"grid_thw[{i}] = {(t, gh, gw, h, w)}: an anyres image of width={w} height={h} is "
                                 f"{expected or '(tiles, s, s, H, W) with a positive H, W'} here (the base tile and "
                                 f"its canvas's tiles); pass the grid_thw the processor gave")
        return rows

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        grid = self.read_grid(grid_thw)
        if not self.config.anyres:
            return [t * self.frame_tokens(h, w) for t, h, w in grid]
        return [packed_tokens(row, self.frame_tokens(*row[1:3]), self.config.geometry) for row in grid]

    def make_plan(self, grid: Grid, device) -> LlavaPlan:
        plan = LlavaPlan(self.encoder.make_plan(tuple(row[:3] for row in grid), device))
        if self.config.anyres:
            index, weight = pack_taps(grid, [self.frame_tokens(*row[1:3]) for row in grid], self.config.geometry)
            plan.pack_index = to_device(index, device)
            plan.pack_weight = None if weight is None else to_device(weight, device)
        return plan

    def features(self, pixel_values: torch.Tensor, plan: LlavaPlan) -> torch.Tensor:
        """The selected hidden states, concatenated: [frames * tokens per frame, hidden * len(layers)]."""
        states = self.encoder(pixel_values, plan.vit, keep=self.layers_used)
        parts = [self.encoder.tokens(states[i], plan.vit, self.drop_first) for i in self.layers_used]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.features(pixel_values, plan)
        width = (self.linear_1.weight.shape[0] + 2 * self.config.out_hidden_size) * x.element_size()
        x = map_rows(self.project, x, width, self.max_intermediate_bytes)  # [tokens, out_hidden]
        if plan.pack_index is None:
            return TowerOutput(x)
        table = torch.cat([x, self.newline.to(x.dtype)[None]])  # the newline is the row after the features
        if plan.pack_weight is None:
            return TowerOutput(table[plan.pack_index])
        packed = F.embedding_bag(plan.pack_index, table.float(), per_sample_weights=plan.pack_weight, mode="sum")
        return TowerOutput(packed.to(x.dtype))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The projector's MLP: x [rows, hidden * layers] -> [rows, out_hidden]."""
        if self.projector_layernorm is not None:
            x = self.projector_layernorm(x)
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


def llava_builtin(vision: dict, text_hidden: int, layer: int, strategy: str,
                  arch: str = "LlavaForConditionalGeneration", model_type: str = "llava", **top) -> dict:
    return builtin_config(arch, model_type, vision, text_config={"hidden_size": text_hidden},
                          projector_hidden_act="gelu", multimodal_projector_bias=True, vision_feature_layer=layer,
                          vision_feature_select_strategy=strategy, **top)


# one group: tower and projector side by side (published checkpoints: vision_tower.vision_model.*, whose
# "vision_model." LlavaTower.load_weights drops; transformers 5 writes vision_tower.*)
LLAVA_WEIGHT_PREFIXES = (("model.vision_tower.", "model.multi_modal_projector."),
                         ("vision_tower.", "multi_modal_projector."))

def register_llava(architecture: str, processor: str, weight_prefixes: tuple, builtins: dict, **spec) -> ModelSpec:
    """A family of this file: LlavaTower under `architecture`, its processor a kind of mmenc.preprocess.PROCESSORS."""
    return register_model(ModelSpec(architectures=(architecture,), tower_cls=LlavaTower,
                                    config_from_hf=LlavaVisionConfig.from_hf, weight_prefixes=weight_prefixes,
                                    processor_from_hf=processor_for(processor),
                                    builtin_configs=builtins, **spec))


LLAVA_SPEC = register_llava(  # LLaVA-1.5
    "LlavaForConditionalGeneration", "clip", LLAVA_WEIGHT_PREFIXES, {
        "llava-hf/llava-1.5-7b-hf": llava_builtin(_CLIP_L14_336, 4096, -2, "default"),
        "llava-hf/llava-1.5-13b-hf": llava_builtin(_CLIP_L14_336, 5120, -2, "default"),
        "llava-hf/llava-interleave-qwen-0.5b-hf": llava_builtin(_SIGLIP_SO400M_26, 896, -1, "full"),
        "llava-hf/llava-interleave-qwen-7b-hf": llava_builtin(_SIGLIP_SO400M_26, 3584, -1, "full"),
    }, vision_model_types=tuple(VISION_TOWERS))

# VipLlava (llava-hf/vip-llava-{7b,13b}-hf): LLaVA-1.5's tower, five layers concatenated, a normed projector.
VIPLLAVA_SPEC = register_llava("VipLlavaForConditionalGeneration", "clip", LLAVA_WEIGHT_PREFIXES, {
    f"llava-hf/vip-llava-{size}-hf": builtin_config(
        "VipLlavaForConditionalGeneration", "vipllava", _CLIP_L14_336, text_config={"hidden_size": width},
        projector_hidden_act="gelu", projector_layernorm_eps=1e-5, vision_feature_layer=[-2, -5, -8, -11, 6])
    for size, width in (("7b", 4096), ("13b", 5120))})


# -- LLaVA-NeXT and LLaVA-OneVision (anyres) ---------------------------------------------------------------
# Published: llava-hf/llava-v1.6-* (CLIP ViT-L/14-336, five canvases up to 2 x 2 / 1 x 3 tiles), and
# llava-hf/llava-onevision-qwen2-*-ov-hf (SigLIP so400m/14-384 without its last layer, 6 x 6 canvases of 384 px,
# anyres_max_9).
_NEXT_PINPOINTS = [list(p) for p in ANYRES["llava_next"][3]]
_ONEVISION_PINPOINTS = [list(p) for p in ANYRES["llava_onevision"][3]]
ANYRES_WEIGHT_PREFIXES = (("model.vision_tower.", "model.multi_modal_projector.", "model.image_"),
                          ("vision_tower.", "multi_modal_projector.", "image_"))


def _next(text_hidden: int) -> dict:
    return llava_builtin(_CLIP_L14_336, text_hidden, -2, "default", "LlavaNextForConditionalGeneration", "llava_next",
                         image_grid_pinpoints=_NEXT_PINPOINTS)


def _onevision(text_hidden: int) -> dict:
    return llava_builtin(_SIGLIP_SO400M_26, text_hidden, -1, "full", "LlavaOnevisionForConditionalGeneration",
                         "llava_onevision", image_grid_pinpoints=_ONEVISION_PINPOINTS,
                         vision_aspect_ratio="anyres_max_9")


_NEXT_SIZES = (("mistral-7b", 4096), ("vicuna-13b", 5120), ("34b", 7168))
_ONEVISION_SIZES = (("0.5b", 896), ("7b", 3584), ("72b", 8192))
LLAVA_NEXT_SPEC = register_llava(
    "LlavaNextForConditionalGeneration", "llava_next", ANYRES_WEIGHT_PREFIXES,
    {f"llava-hf/llava-v1.6-{name}-hf": _next(width) for name, width in _NEXT_SIZES})
LLAVA_ONEVISION_SPEC = register_llava(
    "LlavaOnevisionForConditionalGeneration", "llava_onevision", ANYRES_WEIGHT_PREFIXES,
    {f"llava-hf/llava-onevision-qwen2-{name}-ov-hf": _onevision(width) for name, width in _ONEVISION_SIZES})
