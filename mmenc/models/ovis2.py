"""Ovis2 vision tower (`Ovis2ForConditionalGeneration`'s vision_tower + visual_embeddings_table): fixed
square crops, an AIMv2-style ViT (RMSNorm, SwiGLU MLPs, full attention per crop, no rotary), then
Ovis' visual tokenizer.

Input: the processor cuts an image into k crops of image_size x image_size pixels (a thumbnail first
when there are several; mmenc.preprocess.ovis2): its grid_thw row is (k, s, s) with s = image_size /
patch_size, its pixel_values rows the crops' patches, crop by crop, each in raster order, one row
(C, p, p) per patch. Every crop is one row of a dense [crops, s*s, hidden] batch through the shared
blocks (no padding, no gathers; attention sees the rows as equal segments, cu_seqlens from the plan).

Embeddings: conv patch projection -> RMSNorm -> + learned position table (s*s rows, no interpolation)
-> blocks -> RMSNorm; each m x m block of patches (m = hidden_stride) concatenated in raster order
(dy, dx) -> head_linear -> LayerNorm -> softmax over the visual vocabulary (the last
num_visual_indicator_tokens entries get probability 0) -> times the visual embedding table: rows of
the language model's width, (s/m)^2 per crop, i.e. t * h * w / m^2 per image.

The head's logits are [rows, vocab] (65,536 wide as published: 1.75 GiB in bf16 for 56 crops, and the
norm, softmax and padding each make one more): past `max_intermediate_bytes` for three such tensors it
runs over row blocks (mmenc.layers.row_blocks), each block's embeddings written into the output (not with
batch_invariant=True: the table product is not a token-tiled linear).
"""
import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.norm import LayerNorm, RMSNorm
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, num_row_blocks, split_rows
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import (ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for,
                               vlm_config_dict)
from mmenc.models.registry import register_model


@dataclasses.dataclass(frozen=True)
class Ovis2VisionConfig(TowerConfigBase):
    """Ovis2's vision_config (defaults: transformers' Ovis2VisionConfig, image_size 448 as published).

    spatial_merge_size: hidden_stride; vocab_size: the visual vocabulary (head and embedding table rows);
    out_hidden_size: the language model's width (the config's top-level hidden_size).
    """

    hf_aliases: ClassVar[Mapping[str, tuple[str, ...]]] = {
        "depth": ("num_hidden_layers",), "num_heads": ("num_attention_heads",), "in_channels": ("num_channels",),
        "spatial_merge_size": ("hidden_stride",), "norm_eps": ("rms_norm_eps",), "temporal_patch_size": (),
        "out_hidden_size": ()}

    depth: int = 24
    hidden_size: int = 1024
    num_heads: int = 8
    intermediate_size: int = 2816
    in_channels: int = 3
    image_size: int = 448
    patch_size: int = 14
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    norm_eps: float = 1e-5
    qkv_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    vocab_size: int = 16384
    num_visual_indicator_tokens: int = 5
    tokenize_function: str = "softmax"
    out_hidden_size: int = 1536

    def __post_init__(self):
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "image_size",
                            "patch_size", "temporal_patch_size", "spatial_merge_size", "vocab_size", "out_hidden_size")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"Ovis2VisionConfig: hidden_size={self.hidden_size} must be num_heads={self.num_heads} "
                             f"times the head size")
        side = self.image_size // self.patch_size
        if self.image_size % self.patch_size or side % self.spatial_merge_size:
            raise ValueError(f"Ovis2VisionConfig: image_size={self.image_size} must be patch_size={self.patch_size} "
                             f"times a multiple of hidden_stride={self.spatial_merge_size}")
        if not 0 <= self.num_visual_indicator_tokens < self.vocab_size:
            raise ValueError(f"Ovis2VisionConfig: num_visual_indicator_tokens={self.num_visual_indicator_tokens} "
                             f"must be in 0..vocab_size-1={self.vocab_size - 1}")
        if self.tokenize_function != "softmax":
            raise ValueError(f"Ovis2VisionConfig: tokenize_function={self.tokenize_function!r} is not supported "
                             f"(gumbel_argmax is random, st_argmax is training-time); expected 'softmax'")

    @property
    def tile_side(self) -> int:
        return self.image_size // self.patch_size

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        vlm = vlm_config_dict(config)
        hidden = vlm.get("hidden_size") if "vision_config" in vlm else None
        return {} if hidden is None else {"out_hidden_size": int(hidden)}


class PaddedRowsLinear(ReplicatedLinear):
    """A bias-free linear whose weight has its out_features rounded up to a multiple of 8 rows (zeros past
    the checkpoint's), so its output rows are 16-byte aligned for the GEMMs that read them: forward
    x [..., in] -> [..., padded out]; the first out_features columns are the checkpoint's linear."""

    def __init__(self, in_features: int, out_features: int, prefix: str = "", device=None, dtype=None):
        super().__init__(in_features, -(-out_features // 8) * 8, bias=False, prefix=prefix, device=device,
                         dtype=dtype)
        self.out_features = out_features

    def weight_loader(self, param, loaded, shard_id=None):
        expected = (self.out_features, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"weight {self._pname(param)} has shape {tuple(loaded.shape)}; expected {expected}")
        param.data[:self.out_features].copy_(loaded)
        param.data[self.out_features:].zero_()


@dataclasses.dataclass
class CropPlan:
    """A batch of crops: num_patches rows, `crops` crops; cu_seqlens int32 [crops + 1], max_seqlen: the
    crops' equal segments (s*s tokens each)."""

    num_patches: int
    crops: int
    cu_seqlens: torch.Tensor
    max_seqlen: int


class Ovis2VisionTower(VisionTower):
    """forward(pixel_values [T, C, p, p] or [T, C*p*p], grid_thw int64 [N, 3] of (crops, s, s) rows, on CPU)
    -> TowerOutput(embeddings [T / m^2, out_hidden_size]), crop by crop."""

    # checkpoint (vision_tower. / visual_ removed) -> parameters; the blocks keep the checkpoint's
    # transformer.encoder.layers.N path, inside them the shared VisionBlock's names
    weight_map = WeightMap([
        (".attention.q_proj.", ".attn.qkv.", "q"), (".attention.k_proj.", ".attn.qkv.", "k"),
        (".attention.v_proj.", ".attn.qkv.", "v"), (".attention.out_proj.", ".attn.proj.", None),
        (".rms_norm1.", ".norm1.", None), (".rms_norm2.", ".norm2.", None),
        (".ffn.gate_proj.", ".mlp.gate_up_proj.", 0), (".ffn.up_proj.", ".mlp.gate_up_proj.", 1),
        (".ffn.down_proj.", ".mlp.down_proj.", None),
        ("transformer.embeddings.patch_embedding.", "patch_embed.proj.", None),
        ("transformer.embeddings.rms_norm.", "embed_norm.", None),
        ("transformer.embeddings.position_embedding.weight", "position_embedding", None),
        ("transformer.rms_norm.", "post_norm.", None),
    ])

    def __init__(self, config: Ovis2VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, m, dd = config.hidden_size, self.merge, self.factory_kwargs
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=True, **dd)
        self.embed_norm = RMSNorm(dim, config.norm_eps, **dd)
        self.position_embedding = nn.Parameter(torch.empty(config.tile_side ** 2, dim, **dd), requires_grad=False)
        self.transformer = nn.ModuleDict({"encoder": nn.ModuleDict({"layers": nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="rms", norm_eps=config.norm_eps,
                        mlp="gated", act=config.hidden_act, qkv_bias=config.qkv_bias, mlp_bias=config.mlp_bias,
                        prefix=f"transformer.encoder.layers.{i}", **dd)
            for i in range(config.depth)])})})
        self.post_norm = RMSNorm(dim, config.norm_eps, **dd)
        tokens = config.vocab_size - config.num_visual_indicator_tokens
        self.head_linear = PaddedRowsLinear(dim * m * m, tokens, prefix="head_linear", **dd)
        self.head_norm = LayerNorm(tokens, 1e-5, **dd)  # transformers: nn.LayerNorm's default eps
        self.embeddings_table = nn.Embedding(config.vocab_size, config.out_hidden_size, **dd)
        self.embeddings_table.weight.requires_grad_(False)
        self.max_intermediate_bytes = MAX_INTERMEDIATE_BYTES

    def make_plan(self, grid: Grid, device) -> CropPlan:
        side = self.config.tile_side
        bad = [(i, g) for i, g in enumerate(grid) if g[1:] != (side, side)]
        if bad:
            i, g = bad[0]
            raise ValueError(f"grid_thw[{i}] = {g}: Ovis2 crops are {side} x {side} patches; expected rows "
                             f"(crops, {side}, {side}) as mmenc.preprocess.ovis2 gives them")
        crops = sum(t for t, _, _ in grid)
        cu, max_len = make_cu_seqlens([side * side] * crops, device)
        return CropPlan(crops * side * side, crops, cu, max_len)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        s, m, dim = self.config.tile_side, self.merge, self.config.hidden_size
        x = self.patch_embed(pixel_values.reshape(plan.num_patches, -1)).view(plan.crops, s * s, dim)
        x = self.embed_norm(x) + self.position_embedding.to(x.dtype)  # [B, s*s, dim]
        for block in self.transformer["encoder"]["layers"]:
            x = block(x, plan.cu_seqlens, plan.max_seqlen)  # dense: each crop attends to itself
        x = self.post_norm(x)
        # hidden stride: [B, s/m, dy, s/m, dx, dim] -> [B, s/m, s/m, dy, dx, dim] -> [B*(s/m)^2, m*m*dim]
        x = x.reshape(plan.crops, s // m, m, s // m, m, dim).permute(0, 1, 3, 2, 4, 5).reshape(-1, m * m * dim)
        table = self.embeddings_table.weight.to(x.dtype)  # [vocab, out_hidden]
        # alive at once per row: the logits, the norm's contiguous input and its output (3 x the vocabulary).
        # Batch-invariant towers (token-tiled linears) keep the head whole: the table product is a plain matmul,
        # whose rows' bits may depend on how many rows it gets (a one-row block is a matrix-vector product)
        budget = None if self.head_linear.token_tile is not None else self.max_intermediate_bytes
        blocks = num_row_blocks(x.shape[0], 3 * self.head_linear.weight.shape[0] * x.element_size(), budget)
        if blocks == 1:
            return TowerOutput(self.visual_head(x, table))
        out = x.new_empty(x.shape[0], table.shape[1])
        for rows, dst in zip(split_rows(x, blocks), split_rows(out, blocks)):
            torch.mm(self.visual_head(rows, table, embed=False), table, out=dst)
        return TowerOutput(out)  # [T / m^2, out_hidden]

    def visual_head(self, x: torch.Tensor, table: torch.Tensor, embed: bool = True) -> torch.Tensor:
        """x [rows, m*m*dim] -> the visual-token probabilities [rows, vocab] (indicator tokens 0), or with
        embed=True their embeddings [rows, out_hidden] (probabilities @ table [vocab, out_hidden])."""
        # Both GEMMs on rows whose length is a multiple of 8 (16-byte aligned in bf16): with vocab - indicators
        # = 65531 columns, cuBLAS falls back to slow unaligned kernels. One expression: each temporary is freed
        # as soon as the next is made.
        probs = F.pad(self.head_norm(self.head_linear(x)[:, :self.head_norm.normalized_shape[0]]).softmax(dim=-1),
                      (0, self.config.num_visual_indicator_tokens))  # indicator tokens: probability 0
        return probs @ table if embed else probs


# Published vision configs (config.json of the -hf conversions; AIMv2 448 px towers with hidden_stride 2
# and a 65536-entry visual vocabulary): Ovis2-1B/2B/4B/8B use AIMv2-large (24 x 1024, 8 heads, MLP 2816);
# out_hidden_size is the Qwen2.5 language model's width. Unverified against every config.json: inferred
# from the Ovis2 release (AIMv2 sizes and Qwen2.5 widths).
def _builtin(text_hidden: int) -> dict[str, Any]:
    vision = {"num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 8, "intermediate_size": 2816,
              "num_channels": 3, "image_size": 448, "patch_size": 14, "hidden_stride": 2, "rms_norm_eps": 1e-5,
              "qkv_bias": False, "mlp_bias": False, "hidden_act": "silu", "vocab_size": 65536,
              "num_visual_indicator_tokens": 5, "tokenize_function": "softmax"}
    return builtin_config("Ovis2ForConditionalGeneration", "ovis2", vision, hidden_size=text_hidden,
                          text_config={"hidden_size": text_hidden})


OVIS2_SPEC = register_model(ModelSpec(
    architectures=("Ovis2ForConditionalGeneration",),
    tower_cls=Ovis2VisionTower,
    config_from_hf=Ovis2VisionConfig.from_hf,
    weight_prefixes=(("model.vision_tower.", "model.visual_"), ("vision_tower.", "visual_")),
    processor_from_hf=processor_for("ovis2"),
    builtin_configs={f"thisisiron/Ovis2-{size}-hf": _builtin(hidden)
                     for size, hidden in (("1B", 896), ("2B", 1536), ("4B", 2048), ("8B", 3584))},
))
