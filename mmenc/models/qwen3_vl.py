"""Qwen3-VL vision tower (dense and MoE models share it): patch embedding plus a learned position
table, 2-D rotary, LayerNorm + MLP blocks with full attention per frame, 2x2 patch merger, and
DeepStack features.

Position embedding: a learned side x side table (num_position_embeddings = side^2) resampled to
each frame's h x w patch grid by bilinear interpolation with corners aligned, added after the patch
embedding. Taps and weights are built on the host per (h, w) and cached (mmenc.layers.pos_embed).

Attention: every patch attends to the patches of its own frame (an image is one frame; a video of
t temporal patches is t frames). Tokens stay in merge-block order throughout, so the merger's 2x2
blocks are contiguous and no permutation is needed.

DeepStack: after each layer listed in `deepstack_visual_indexes`, that layer's hidden states go
through their own merger (`deepstack_merger_list[k]`, LayerNorm over the merged 4*hidden vector
instead of per patch). `TowerOutput.extras["deepstack"]` is the list of those outputs in layer
order, each [T / merge^2, out_hidden_size] with rows in the same token order as `embeddings`
(images in grid order); the language model adds feature k to its hidden states after layer k.

Qwen3-Omni's vision encoder (`thinker.visual` of Qwen3OmniMoeForConditionalGeneration) is this tower
with other checkpoint names (mergers' MLP as mlp.0 / mlp.2, the DeepStack mergers as merger_list)
and its vision_config under thinker_config: `Qwen3OmniVisionTower` only renames.
"""
import dataclasses
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid
from mmenc.layers.plan import PackPlan, frame_plan
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model


@dataclasses.dataclass(frozen=True)
class Qwen3VisionConfig(TowerConfigBase):
    """Qwen3-VL's vision_config. Defaults are transformers' Qwen3VLVisionConfig defaults.

    hidden_size: the tower's width; out_hidden_size: the output width (the language model's).
    num_position_embeddings: entries of the learned square position table (side^2).
    deepstack_visual_indexes: layers whose outputs also leave through a DeepStack merger.
    """

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    out_hidden_size: int = 3584
    hidden_act: str = "gelu_pytorch_tanh"
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "deepstack_visual_indexes", tuple(int(i) for i in self.deepstack_visual_indexes))
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size",
                            "num_position_embeddings")
        self.check_rotary_heads()
        side = int(self.num_position_embeddings ** 0.5 + 0.5)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"Qwen3VisionConfig.num_position_embeddings={self.num_position_embeddings} must be a "
                             f"square (the learned position grid is side x side)")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad or len(set(self.deepstack_visual_indexes)) != len(self.deepstack_visual_indexes):
            raise ValueError(f"Qwen3VisionConfig.deepstack_visual_indexes={list(self.deepstack_visual_indexes)} "
                             f"must be distinct layers in 0..{self.depth - 1}")

    def processor_defaults(self) -> dict[str, Any]:
        """The published checkpoints' processor class and patch keys at this tower's sizes; mmenc's Qwen3-VL
        preset sets the same, written out for a peer built from them (transformers' class defaults are
        Qwen2-VL's: patch 14). No pixel bounds: the video processor reads these too, and its bounds differ."""
        return {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": self.patch_size,
                "temporal_patch_size": self.temporal_patch_size, "merge_size": self.spatial_merge_size,
                "image_mean": [0.5] * 3, "image_std": [0.5] * 3}


class Qwen3VisionTower(VisionTower):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, out_hidden_size] (images in grid order) and extras["deepstack"], a list
    of len(deepstack_visual_indexes) tensors of the same shape and token order."""

    # linear_fc1/2 (blocks and mergers) -> fc1/2, the mergers' norm -> ln_q
    weight_map = WeightMap([("linear_fc1.", "fc1.", None), ("linear_fc2.", "fc2.", None), (".norm.", ".ln_q.", None)])
    deepstack_module: ClassVar[str] = "deepstack_merger_list"  # the DeepStack mergers' checkpoint name
    plan_cache_size = 32

    def __init__(self, config: Qwen3VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, m, dd = config.hidden_size, self.merge, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.pos_embed = InterpolatedPosEmbed(config.num_position_embeddings, dim, mode="bilinear",
                                              align_corners=True, merge_size=m, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=m)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="layer", norm_eps=config.norm_eps,
                        mlp="plain", act=config.hidden_act, prefix=f"blocks.{i}", **dd)
            for i in range(config.depth)])
        merger = dict(norm="layer", norm_eps=config.norm_eps, act="gelu", **dd)
        self.merger = PatchMerger(config.out_hidden_size, dim, m, **merger)
        setattr(self, self.deepstack_module, nn.ModuleList([
            PatchMerger(config.out_hidden_size, dim, m, norm_after_merge=True, **merger)
            for _ in config.deepstack_visual_indexes]))
        self.deepstack_layers = {layer: k for k, layer in enumerate(config.deepstack_visual_indexes)}

    def make_plan(self, grid: Grid, device) -> PackPlan:
        return frame_plan(grid, device, self.rotary, self.pos_embed)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [T, hidden]
        x = x + self.pos_embed(plan.pos_index, plan.pos_weight).to(x.dtype)
        rotary = (plan.cos, plan.sin)
        mergers = getattr(self, self.deepstack_module)
        deepstack = []  # in layer order
        for i, block in enumerate(self.blocks):
            x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
            k = self.deepstack_layers.get(i)
            if k is not None:
                deepstack.append(mergers[k](x))  # [T / m^2, out_hidden]
        return TowerOutput(self.merger(x), {"deepstack": deepstack})


def _builtin(arch: str, model_type: str, depth: int, hidden: int, intermediate: int, out_hidden: int,
             deepstack: list[int]) -> dict[str, Any]:
    vision = {"depth": depth, "hidden_size": hidden, "intermediate_size": intermediate, "num_heads": 16,
              "out_hidden_size": out_hidden, "deepstack_visual_indexes": deepstack, "hidden_act": "gelu_pytorch_tanh",
              "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "num_position_embeddings": 2304}
    return builtin_config(arch, model_type, vision, text_config={"hidden_size": out_hidden})


_DENSE, _MOE = ("Qwen3VLForConditionalGeneration", "qwen3_vl"), ("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe")
# Published vision configs (see each model's config.json). 2B/4B: 24 layers of 1024 (head 64);
# the others: 27 layers of 1152 (head 72). out_hidden_size is the language model's hidden size.
QWEN3_VL_BUILTINS = {
    "Qwen/Qwen3-VL-2B-Instruct": _builtin(*_DENSE, 24, 1024, 4096, 2048, [5, 11, 17]),
    "Qwen/Qwen3-VL-4B-Instruct": _builtin(*_DENSE, 24, 1024, 4096, 2560, [5, 11, 17]),
    "Qwen/Qwen3-VL-8B-Instruct": _builtin(*_DENSE, 27, 1152, 4304, 4096, [8, 16, 24]),
    "Qwen/Qwen3-VL-32B-Instruct": _builtin(*_DENSE, 27, 1152, 4304, 5120, [8, 16, 24]),
    "Qwen/Qwen3-VL-30B-A3B-Instruct": _builtin(*_MOE, 27, 1152, 4304, 2048, [8, 16, 24]),
    # Unverified against the published config.json (inferred: same tower as 8B/32B, out = text hidden 4096).
    "Qwen/Qwen3-VL-235B-A22B-Instruct": _builtin(*_MOE, 27, 1152, 4304, 4096, [8, 16, 24]),
}

QWEN3_VL_SPEC = register_model(ModelSpec(
    architectures=(_DENSE[0], _MOE[0]),
    vision_architectures=("Qwen3VLVisionModel", "Qwen3VLMoeVisionModel"),
    tower_cls=Qwen3VisionTower,
    config_from_hf=Qwen3VisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=processor_for("qwen3_vl"),
    builtin_configs=QWEN3_VL_BUILTINS,
))


class Qwen3OmniVisionTower(Qwen3VisionTower):
    """Qwen3-Omni's vision encoder: Qwen3VisionTower's math and outputs under Qwen3-Omni's checkpoint
    names (mergers: mlp.0 / mlp.2 for fc1 / fc2; DeepStack mergers: merger_list)."""

    weight_map = WeightMap([("linear_fc1.", "fc1.", None), ("linear_fc2.", "fc2.", None),
                            (".mlp.0.", ".fc1.", None), (".mlp.2.", ".fc2.", None)])
    deepstack_module = "merger_list"


_OMNI = "Qwen3OmniMoeForConditionalGeneration"


def _omni_builtin(out_hidden: int) -> dict[str, Any]:
    """Qwen3-Omni's config.json shape: the vision-language part under thinker_config."""
    vlm = _builtin(_OMNI, "qwen3_omni_moe", 27, 1152, 4304, out_hidden, [8, 16, 24])
    return {"architectures": [_OMNI], "model_type": "qwen3_omni_moe", "torch_dtype": "bfloat16",
            "thinker_config": {"vision_config": vlm["vision_config"], "text_config": vlm["text_config"]}}


# Published thinker_config.vision_config of Qwen3-Omni-30B-A3B (Instruct / Thinking / Captioner share
# the tower): Qwen3-VL's 27 x 1152 tower (transformers' Qwen3OmniMoeVisionEncoderConfig defaults) with
# out_hidden_size 2048, the thinker's text hidden size.
QWEN3_OMNI_BUILTINS = {f"Qwen/Qwen3-Omni-30B-A3B-{kind}": _omni_builtin(2048)
                       for kind in ("Instruct", "Thinking", "Captioner")}

QWEN3_OMNI_SPEC = register_model(ModelSpec(
    architectures=(_OMNI,),
    vision_architectures=("Qwen3OmniMoeVisionEncoder",),
    tower_cls=Qwen3OmniVisionTower,
    config_from_hf=Qwen3VisionConfig.from_hf,
    weight_prefixes=("thinker.visual.", "thinker.model.visual."),
    # transformers maps qwen3_omni_moe to Qwen2VLImageProcessor (Qwen3-VL's class); without a
    # preprocessor_config.json the Qwen3-VL preset (patch 16 as the tower needs, mean/std 0.5) applies,
    # and a checkpoint's own file overrides every key it sets.
    processor_from_hf=processor_for("qwen3_vl"),
    builtin_configs=QWEN3_OMNI_BUILTINS,
))
