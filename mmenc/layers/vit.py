"""CLIP-style ViT encoders, shared by the towers built on them (CLIP, and SigLIP inside LLaVA-family VLMs).

Per frame of h x w patches (an image is one frame; a grid row (t, h, w) is t frames):
  patch embedding (a convolution as one matmul; bias for SigLIP, none for CLIP);
  a class token in front (CLIP), its own position row (row 0 of the table);
  learned positions: the table's side x side grid added as is at its trained size, else resampled
  bicubically (align_corners=False) to h x w: transformers' interpolate_pos_encoding=True; or with
  positions="bucket" (Idefics3 / SmolVLM, NaViT-style) each patch takes the table row of its fractional
  coordinates bucketed into side x side cells (`bucket_positions`);
  pre-LayerNorm over all tokens (CLIP's `pre_layrnorm`);
  LayerNorm blocks (fused qkv with bias, plain MLP: quick_gelu, gelu or gelu-tanh) within the frame.
`ViTEncoder.forward` returns the hidden states a caller asks for, by transformers' `hidden_states`
index: 0 is the embeddings (after the pre-norm), i the output of block i; only blocks up to the
deepest index asked for exist (`depth` is that index).

Frames of one size run as a dense [frames, seq, D] batch (seq = 1 + h*w with the class token); frames
of different sizes are packed into one varlen call (one segment per frame, the class token first in
its segment), never padded. `tokens(x, plan, drop_first)` gives a hidden state's rows frame by frame,
[frames * (seq - drop_first), D] ("default" strategy: the first token of each frame dropped).
"""
import dataclasses
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, frame_lengths, num_patches
from mmenc.layers.norm import LayerNorm
from mmenc.layers.pos_embed import InterpolatedPosEmbed
from mmenc.layers.vision_blocks import PatchEmbed, VisionBlock
from mmenc.layers.weights import SIGLIP_ENCODER_RULES, Rule
from mmenc.utils.device_copy import to_device


def vit_weight_rules(prefix: str) -> tuple[Rule, ...]:
    """transformers' CLIP / SigLIP vision-model names -> a ViTEncoder's parameters under `prefix`
    (e.g. "encoder."): embeddings, pre_layrnorm and the encoder layers (SIGLIP_ENCODER_RULES)."""
    return (("embeddings.patch_embedding.", f"{prefix}patch_embed.proj.", None),
            ("embeddings.class_embedding", f"{prefix}class_embedding", None),
            ("embeddings.position_embedding.weight", f"{prefix}pos_embed.weight", None),
            ("pre_layrnorm.", f"{prefix}pre_norm.", None),
            *SIGLIP_ENCODER_RULES)


def feature_index(layer: int, depth: int, where: str = "vision_feature_layer") -> int:
    """transformers' hidden_states index (negative counts from the end of depth + 1 states) -> 0..depth."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not -(depth + 1) <= layer <= depth:
        raise ValueError(f"{where}={layer!r} is not a hidden-state index of a {depth}-layer tower; expected an "
                         f"int in [{-(depth + 1)}, {depth}] (0: the embeddings, -1: the last layer)")
    return layer % (depth + 1)


ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new")


def check_vit_config(config: Any) -> None:
    """The checks every CLIP-style tower config shares: positive sizes, heads dividing the width, a
    known activation and at least one patch per side."""
    config.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
                          "image_size")
    name = type(config).__name__
    if config.hidden_size % config.num_heads:
        raise ValueError(f"{name}: hidden_size={config.hidden_size} is not divisible by num_heads={config.num_heads}; "
                         f"expected a divisor")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"{name}.hidden_act={config.hidden_act!r}; expected one of {ACTIVATIONS}")
    if config.image_size < config.patch_size:
        raise ValueError(f"{name}: image_size={config.image_size} is smaller than patch_size={config.patch_size}; "
                         f"expected at least one patch per side")


def vit_encoder(config: Any, depth: int, **dd) -> "ViTEncoder":
    """The ViTEncoder of a CLIP or SigLIP vision_config (config.tower), `depth` layers of it."""
    clip = config.tower == "clip"
    return ViTEncoder(dim=config.hidden_size, num_heads=config.num_heads, mlp_hidden=config.intermediate_size,
                      depth=depth, act=config.hidden_act, norm_eps=config.layer_norm_eps,
                      patch_features=config.patch_features, position_side=config.image_size // config.patch_size,
                      patch_bias=not clip, class_token=clip, pre_norm=clip, **dd)


def tower_tensors(weights: Iterable[tuple[str, torch.Tensor]], built_depth: int
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A VLM's vision-tower tensors (names under its tower prefix) as a ViTEncoder of `built_depth` layers
    reads them: a leading "vision_model." dropped (CLIPVisionModel / SiglipVisionModel inside published
    checkpoints; transformers 5 writes none), and what those layers' features never read left out:
    later layers, post_layernorm, SigLIP's pooling head."""
    for name, tensor in weights:
        name = name.removeprefix("vision_model.")
        match = re.match(r"encoder\.layers\.(\d+)\.", name)
        if not (match and int(match.group(1)) >= built_depth) and not name.startswith(("post_layernorm.", "head.")):
            yield name, tensor


def bucket_positions(h: int, w: int, side: int) -> torch.Tensor:
    """Idefics3VisionEmbeddings' position ids of an h x w frame over a side x side table: row i sits at the
    fraction i / h, bucketed by the boundaries 1/side, 2/side, ... (float32, as transformers computes them,
    so the buckets match to the last rounding); int64 [h*w], raster order."""
    boundaries = torch.arange(1 / side, 1.0, 1 / side)
    rows = torch.bucketize((torch.arange(h, dtype=torch.float32) * (1.0 / torch.tensor(h))).clamp(max=1 - 1e-6),
                           boundaries, right=True)
    cols = torch.bucketize((torch.arange(w, dtype=torch.float32) * (1.0 / torch.tensor(w))).clamp(max=1 - 1e-6),
                           boundaries, right=True)
    return (rows[:, None] * side + cols[None, :]).reshape(-1)


@dataclasses.dataclass
class ViTPlan:
    """What a forward derives from grid_thw, once (device tensors, cached per grid).

    dense: every frame has `seq` tokens (run as [frames, seq, D]); else packed by cu_seqlens, with
    `patch_slots` int64 [T] (each patch's row in the packed sequence) and `tail_slots` int64 (every row
    but each frame's first) when there is a class token or a first token to drop.
    pos_index / pos_weight: taps into the position table (None: every frame is the table's size).
    """

    num_patches: int
    frames: int
    dense: bool
    seq: int
    cu_seqlens: torch.Tensor
    max_seqlen: int
    pos_index: torch.Tensor | None
    pos_weight: torch.Tensor | None
    patch_slots: torch.Tensor | None = None
    cls_slots: torch.Tensor | None = None
    tail_slots: torch.Tensor | None = None


class ViTEncoder(nn.Module):
    """See the module docstring. forward(pixel_values [T, C*p*p], plan, keep) -> {index: hidden state}."""

    def __init__(self, *, dim: int, num_heads: int, mlp_hidden: int, depth: int, act: str, norm_eps: float,
                 patch_features: int, position_side: int, patch_bias: bool, class_token: bool, pre_norm: bool,
                 positions: str = "bicubic", prefix: str = "encoder", device=None, dtype=None):
        super().__init__()
        dd = {"device": device, "dtype": dtype}
        if positions not in ("bicubic", "bucket") or (positions == "bucket" and class_token):
            raise ValueError(f"{prefix}: positions={positions!r} with class_token={class_token}; expected "
                             f"'bicubic', or 'bucket' without a class token")
        self.depth, self.positions = depth, positions
        self.patch_embed = PatchEmbed(patch_features, dim, bias=patch_bias, prefix=f"{prefix}.patch_embed", **dd)
        self.class_embedding = nn.Parameter(torch.empty(dim, **dd), requires_grad=False) if class_token else None
        self.pos_embed = InterpolatedPosEmbed(position_side ** 2, dim, mode="bicubic", leading_rows=int(class_token),
                                              **dd)
        self.pre_norm = LayerNorm(dim, norm_eps, **dd) if pre_norm else None
        self.layers = nn.ModuleList([
            VisionBlock(dim, num_heads, mlp_hidden, norm="layer", norm_eps=norm_eps, mlp="plain", act=act,
                        prefix=f"{prefix}.layers.{i}", **dd)
            for i in range(depth)])

    @property
    def class_token(self) -> bool:
        return self.class_embedding is not None

    def make_plan(self, grid: Grid, device) -> ViTPlan:
        lengths = frame_lengths(grid)
        extra = int(self.class_token)
        side = self.pos_embed.side
        native = all((h, w) == (side, side) for _, h, w in grid) and self.positions == "bicubic"
        dense = len(set(lengths)) == 1
        if self.positions == "bucket":  # one table row per patch: taps of weight 1
            frames = [bucket_positions(h, w, side) for _, h, w in (grid[:1] if dense else grid)]
            ids = frames[0] if dense else torch.cat([f.repeat(t) for (t, _, _), f in zip(grid, frames)])
            index, weight = to_device(ids[:, None], device), to_device(torch.ones(len(ids), 1), device)
        elif native:
            index = weight = None
        elif dense:  # one frame's taps, shared by the batch's rows
            index, weight = (to_device(t, device) for t in self.pos_embed.frame_taps(*grid[0][1:]))
        else:
            index, weight = self.pos_embed.taps(grid, device)
        cu, max_len = make_cu_seqlens([n + extra for n in lengths], device)
        plan = ViTPlan(num_patches(grid), len(lengths), dense, lengths[0] + extra, cu, max_len, index, weight)
        if not dense:
            starts = torch.tensor([0, *lengths]).cumsum(0)[:-1] + torch.arange(len(lengths)) * extra  # frame starts
            rows = torch.arange(sum(lengths) + extra * len(lengths))
            first = torch.zeros_like(rows, dtype=torch.bool)
            first[starts] = True
            plan.tail_slots = to_device(rows[~first], device)
            if extra:
                plan.patch_slots, plan.cls_slots = plan.tail_slots, to_device(starts, device)
        return plan

    def embed(self, pixel_values: torch.Tensor, plan: ViTPlan) -> torch.Tensor:
        """Patch embedding + class token + positions (+ pre-norm): hidden state 0, dense [frames, seq, D]
        or packed [T (+ frames), D]."""
        x = self.patch_embed(pixel_values.reshape(plan.num_patches, -1))  # [T, D]
        table = self.pos_embed.weight
        start = int(self.class_token)
        if plan.pos_index is None:
            pos = table[start:]
        else:
            pos = self.pos_embed(plan.pos_index, plan.pos_weight)
        if plan.dense:
            x = x.view(plan.frames, -1, x.shape[-1]) + pos.to(x.dtype)  # [F, h*w, D]
            if self.class_token:
                cls = (self.class_embedding + table[0]).to(x.dtype)
                x = torch.cat([cls.expand(plan.frames, 1, -1), x], dim=1)  # [F, 1 + h*w, D]
        else:  # packed frames are never all at the table's size (that is dense): pos [T, D]
            x = x + pos.to(x.dtype)
            if self.class_token:
                packed = x.new_empty(x.shape[0] + plan.frames, x.shape[-1])
                packed[plan.patch_slots] = x
                packed[plan.cls_slots] = (self.class_embedding + table[0]).to(x.dtype)
                x = packed
        return self.pre_norm(x) if self.pre_norm is not None else x

    def forward(self, pixel_values: torch.Tensor, plan: ViTPlan, keep: tuple[int, ...]) -> dict[int, torch.Tensor]:
        """{i: hidden state i} for i in keep (0..depth), each in the embedding's layout (see `embed`)."""
        x = self.embed(pixel_values, plan)
        out = {0: x} if 0 in keep else {}
        for i, layer in enumerate(self.layers, start=1):
            x = layer(x, plan.cu_seqlens, plan.max_seqlen)
            if i in keep:
                out[i] = x
        return out

    @staticmethod
    def tokens(x: torch.Tensor, plan: ViTPlan, drop_first: bool) -> torch.Tensor:
        """A hidden state's rows frame by frame, [frames * (seq - drop_first), D]: every token, or all but
        the first of each frame (the class token, or a first patch where there is none)."""
        if plan.dense:
            return (x[:, 1:] if drop_first else x).reshape(-1, x.shape[-1])
        return x[plan.tail_slots] if drop_first else x
