"""PaliGemma (`PaliGemmaForConditionalGeneration`) and Gemma 3 (`Gemma3ForConditionalGeneration`): a SigLIP
tower and the VLM's projector.

Per frame (an image is one frame; a grid row (t, h, w) is t frames) the tower is mmenc.layers.vit.ViTEncoder
with SigLIP's settings (patch bias, learned positions, gelu-tanh blocks), every layer, then post_layernorm
(transformers' last_hidden_state). The projector:
  PaliGemma: one linear (bias) to projection_dim, per token: [h*w, projection_dim] a frame. transformers 5.24's
    get_image_features applies no scaling (no division by sqrt(hidden) in its source). Frames not at the
    position table's size get it resampled bicubically (transformers' interpolate_pos_encoding=True); the
    processor always gives the trained size.
  Gemma 3: the frame's side x side patches average-pooled in k x k blocks (k = side // sqrt(mm_tokens_per_image),
    a partial last block dropped, as nn.AvgPool2d), Gemma's RMSNorm (weight as an offset from 1, float32),
    then the matmul with mm_input_projection_weight [vision hidden, text hidden] (no bias):
    [(side // k)^2, text hidden] a frame. Only frames at the trained size (side x side) are accepted, as in
    transformers, whose projector reshapes to that grid.
Embeddings: transformers' get_image_features(pixel_values).pooler_output, frames concatenated.
The projector is replicated over tensor-parallel ranks (the tower's blocks shard).
"""
import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from mmenc.layers.grid import Grid
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.norm import GemmaRMSNorm, LayerNorm
from mmenc.layers.vit import ViTPlan, check_vit_config, vit_encoder, vit_weight_rules
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model

PROJECTORS = ("paligemma", "gemma3")


@dataclasses.dataclass(frozen=True)
class GemmaSiglipConfig(TowerConfigBase):
    """The SigLIP vision_config plus the projector (top level of config.json). Defaults: PaliGemmaConfig's
    (SigLIP so400m-like at 224 px, projection_dim 2048).

    projector: "paligemma" (a linear) or "gemma3" (pool + norm + matmul); tokens_per_side: Gemma 3's
    int(sqrt(mm_tokens_per_image)); out_hidden_size: projection_dim (PaliGemma) or text hidden (Gemma 3).
    """

    hf_aliases: ClassVar = {"depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",),
                            "in_channels": ("num_channels",), "projector": (), "out_hidden_size": (),
                            "tokens_per_side": (), "spatial_merge_size": ()}
    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4096
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 14
    image_size: int = 224
    layer_norm_eps: float = 1e-6
    projector: str = "paligemma"
    out_hidden_size: int = 2048
    tokens_per_side: int = 16
    spatial_merge_size: int = 1

    def __post_init__(self):
        check_vit_config(self)
        self.check_positive("out_hidden_size", "tokens_per_side")
        if self.projector not in PROJECTORS:
            raise ValueError(f"GemmaSiglipConfig.projector={self.projector!r}; expected one of {PROJECTORS}")
        if self.projector == "gemma3" and self.side < self.tokens_per_side:
            raise ValueError(f"Gemma 3: mm_tokens_per_image gives {self.tokens_per_side} tokens a side but the tower "
                             f"has {self.side} patches a side (image_size={self.image_size} // patch_size="
                             f"{self.patch_size}); expected at most one token per patch")

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        if "Gemma3ForConditionalGeneration" in (config.get("architectures") or ()):
            text = config.get("text_config") or {}
            return {"projector": "gemma3", "out_hidden_size": int(text.get("hidden_size", 2304)),
                    "tokens_per_side": int(int(config.get("mm_tokens_per_image") or 256) ** 0.5)}
        out = config.get("projection_dim") or vision.get("projection_dim") or 2048
        return {"projector": "paligemma", "out_hidden_size": int(out)}

    def processor_defaults(self) -> dict[str, Any]:
        """The patch size and the trained image size (a checkpoint's preprocessor_config.json states the size)."""
        return {"patch_size": self.patch_size, "size": {"height": self.image_size, "width": self.image_size}}

    @property
    def tower(self) -> str:
        return "siglip"

    @property
    def temporal_patch_size(self) -> int:
        return 1

    @property
    def side(self) -> int:
        """Patches a side at the trained size (a partial last patch dropped, as the convolution does)."""
        return self.image_size // self.patch_size

    @property
    def pool_kernel(self) -> int:
        """Gemma 3's average-pool kernel (and stride): side // tokens_per_side."""
        return self.side // self.tokens_per_side


class GemmaSiglipTower(VisionTower):
    """forward(pixel_values [T, C*p*p] (each frame's patches in raster order), grid_thw int64 [N, 3]) ->
    TowerOutput with embeddings [tokens, out_hidden_size]: PaliGemma h*w a frame, Gemma 3 (side // k)^2 a
    frame (Gemma 3 takes only (t, side, side) rows)."""

    weight_map = WeightMap(vit_weight_rules("encoder."))
    plan_cache_size = 32
    check_patch_features = True

    def __init__(self, config: GemmaSiglipConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dd, dim = self.factory_kwargs, config.hidden_size
        self.encoder = vit_encoder(config, config.depth, **dd)
        self.post_layernorm = LayerNorm(dim, config.layer_norm_eps, **dd)
        gemma3 = config.projector == "gemma3"
        self.norm = GemmaRMSNorm(dim, config.layer_norm_eps, **dd) if gemma3 else None
        self.projection = ReplicatedLinear(dim, config.out_hidden_size, bias=not gemma3, prefix="projection", **dd)

    def read_grid(self, grid_thw: torch.Tensor) -> Grid:
        grid = super().read_grid(grid_thw)
        side = self.config.side
        if self.norm is not None:
            for i, (t, h, w) in enumerate(grid):
                if (h, w) != (side, side):
                    raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: Gemma 3 pools a frame of {side}x{side} patches "
                                     f"(image_size={self.config.image_size}, patch_size={self.config.patch_size}); "
                                     f"expected (t, {side}, {side}) rows, as its processor gives")
        return grid

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        grid = self.read_grid(grid_thw)
        if self.norm is None:
            return [t * h * w for t, h, w in grid]
        pooled = self.config.side // self.config.pool_kernel
        return [t * pooled * pooled for t, _, _ in grid]

    def make_plan(self, grid: Grid, device) -> ViTPlan:
        return self.encoder.make_plan(grid, device)

    def pool(self, x: torch.Tensor, frames: int) -> torch.Tensor:
        """Gemma 3's average pool: [frames * side^2, D] -> [frames * n^2, D], n = side // k, in float32."""
        side, k = self.config.side, self.config.pool_kernel
        n = side // k
        x = x.view(frames, side, side, -1)[:, :n * k, :n * k].float()
        return x.reshape(frames, n, k, n, k, -1).mean(dim=(2, 4)).reshape(frames * n * n, -1)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.encoder(pixel_values, plan, keep=(self.config.depth,))[self.config.depth]
        x = self.encoder.tokens(self.post_layernorm(x), plan, drop_first=False)  # [T, D], frame by frame
        if self.norm is not None:
            x = self.norm(self.pool(x, plan.frames)).to(x.dtype)
        return TowerOutput(self.projection(x))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed():
            for name, tensor in weights:
                name = name.removeprefix("vision_model.")  # published checkpoints; transformers 5 writes none
                if name.startswith("head."):  # SigLIP's pooling head (vision_use_head), unused by the VLM
                    continue
                if name == "mm_input_projection_weight":  # [vision hidden, text hidden]: a matmul's right side
                    yield "projection.weight", tensor.t()
                elif name.startswith("mm_soft_emb_norm."):
                    yield "norm." + name.removeprefix("mm_soft_emb_norm."), tensor
                elif name.startswith("linear."):
                    yield "projection." + name.removeprefix("linear."), tensor
                else:
                    yield name, tensor
        return super().load_weights(renamed())


_WEIGHT_PREFIXES = (("model.vision_tower.", "model.multi_modal_projector."),
                    ("vision_tower.", "multi_modal_projector."))

# Published sizes (sizes inferred from the releases, not checked against their config.json files): every one
# is SigLIP so400m/14 (27 x 1152, MLP 4304, 16 heads); PaliGemma at 224 px under Gemma 2B (2048 wide),
# PaliGemma 2 at 448 px under Gemma 2 2B / 9B (2304 / 3584); Gemma 3 at 896 px (64 x 64 patches pooled to
# 16 x 16 = 256 tokens) under its 4B / 12B / 27B language models (2560 / 3840 / 5376 wide).
_SO400M = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
           "num_hidden_layers": 27, "num_attention_heads": 16, "patch_size": 14, "hidden_act": "gelu_pytorch_tanh",
           "layer_norm_eps": 1e-6, "vision_use_head": False}


def _paligemma(image_size: int, width: int) -> dict[str, Any]:
    return builtin_config("PaliGemmaForConditionalGeneration", "paligemma",
                          {**_SO400M, "image_size": image_size, "projection_dim": width},
                          text_config={"hidden_size": width}, projection_dim=width)


def _gemma3(width: int) -> dict[str, Any]:
    return builtin_config("Gemma3ForConditionalGeneration", "gemma3", {**_SO400M, "image_size": 896},
                          text_config={"hidden_size": width}, mm_tokens_per_image=256)


PALIGEMMA_SPEC = register_model(ModelSpec(
    architectures=("PaliGemmaForConditionalGeneration",),
    tower_cls=GemmaSiglipTower,
    config_from_hf=GemmaSiglipConfig.from_hf,
    weight_prefixes=_WEIGHT_PREFIXES,
    processor_from_hf=processor_for("siglip"),  # PaliGemmaProcessor's SiglipImageProcessor
    builtin_configs={
        "google/paligemma-3b-pt-224": _paligemma(224, 2048),
        "google/paligemma2-3b-pt-448": _paligemma(448, 2304),
        "google/paligemma2-10b-pt-448": _paligemma(448, 3584),
    },
))

GEMMA3_SPEC = register_model(ModelSpec(
    architectures=("Gemma3ForConditionalGeneration",),
    tower_cls=GemmaSiglipTower,
    config_from_hf=GemmaSiglipConfig.from_hf,
    weight_prefixes=_WEIGHT_PREFIXES,
    processor_from_hf=processor_for("gemma3"),  # Gemma3ImageProcessor without pan-and-scan
    builtin_configs={
        "google/gemma-3-4b-it": _gemma3(2560),
        "google/gemma-3-12b-it": _gemma3(3840),
        "google/gemma-3-27b-it": _gemma3(5376),
    },
))
