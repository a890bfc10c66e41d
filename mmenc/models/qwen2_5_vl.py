"""Qwen2.5-VL vision tower: Qwen2-VL's layout with RMSNorm + SwiGLU blocks and window attention.

Window attention: the merged-token grid of each frame is cut into windows of
window_size / (patch_size * merge) merged tokens per side (edge windows are smaller). Tokens are
permuted once, after the patch embedding, so every window is contiguous; layers in
fullatt_block_indexes attend over whole frames (still contiguous: windows never cross frames), the
others within windows. The merger's output is put back into image order with the inverse
permutation. Permutations, rotary tables and both cu_seqlens are computed on the host from the CPU
grid_thw once per forward and cached per (t, h, w) and per grid.
"""
import dataclasses
from typing import ClassVar

import torch
import torch.nn as nn

from mmenc.attention import make_cu_seqlens
from mmenc.layers.grid import Grid, frame_lengths
from mmenc.layers.plan import PackPlan
from mmenc.layers.rotary import VisionRotary2D
from mmenc.layers.vision_blocks import PatchEmbed, PatchMerger, VisionBlock
from mmenc.layers.weights import WeightMap
from mmenc.models.base import ModelSpec, TowerConfigBase, TowerOutput, VisionTower, builtin_config, processor_for
from mmenc.models.registry import register_model
from mmenc.utils.device_copy import to_device
from mmenc.utils.lru import LRUCache


@dataclasses.dataclass(frozen=True)
class Qwen2_5_VisionConfig(TowerConfigBase):
    """Qwen2.5-VL's vision_config. Defaults are transformers' Qwen2_5_VLVisionConfig defaults.

    hidden_size: the tower's width; out_hidden_size: the output width (the language model's).
    window_size: a window's side in pixels; fullatt_block_indexes: layers attending whole frames.
    """

    hf_aliases: ClassVar = {"in_channels": ("in_channels", "in_chans"), "patch_size": ("patch_size", "spatial_patch_size")}
    depth: int = 32
    hidden_size: int = 3584
    num_heads: int = 16
    intermediate_size: int = 3420
    out_hidden_size: int = 3584
    hidden_act: str = "silu"
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "fullatt_block_indexes", tuple(int(i) for i in self.fullatt_block_indexes))
        self.check_positive("depth", "hidden_size", "num_heads", "intermediate_size", "out_hidden_size",
                            "in_channels", "patch_size", "temporal_patch_size", "spatial_merge_size", "window_size")
        self.check_rotary_heads()
        unit = self.patch_size * self.spatial_merge_size
        if self.window_size % unit:
            raise ValueError(f"Qwen2_5_VisionConfig.window_size={self.window_size} must be a multiple of "
                             f"patch_size * spatial_merge_size = {unit}")
        bad = [i for i in self.fullatt_block_indexes if not 0 <= i < self.depth]
        if bad:
            raise ValueError(f"Qwen2_5_VisionConfig.fullatt_block_indexes has {bad} outside 0..{self.depth - 1}")

    @property
    def merged_window(self) -> int:
        """A window's side in merged tokens."""
        return self.window_size // (self.patch_size * self.spatial_merge_size)


def window_order(t: int, h: int, w: int, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """Windows of one (t, h, w) item, over its merged-token grid [t, h/merge, w/merge].

    Returns (order int64 [t*h*w/merge^2], lengths): merged token `order[i]` (raster index within the
    item) is the i-th in window order -- frame by frame, windows in raster order, tokens in raster
    order inside a window -- and `lengths` lists each window's size in merged tokens.
    """
    lh, lw = h // merge, w // merge
    nh, nw = -(-lh // window), -(-lw // window)
    f = torch.arange(t).view(t, 1, 1)
    r = torch.arange(lh).view(1, lh, 1)
    c = torch.arange(lw).view(1, 1, lw)
    window_id = (f * nh + r // window) * nw + c // window  # [t, lh, lw]
    inner = (r % window) * window + c % window
    key = (window_id * window * window + inner).reshape(-1)
    order = torch.argsort(key)
    lengths = torch.bincount(window_id.reshape(-1), minlength=t * nh * nw)
    return order, [n for n in lengths.tolist() if n > 0]


class Qwen2_5_VisionTower(VisionTower):
    """forward(pixel_values [T, C*tp*p*p], grid_thw int64 [N, 3] on CPU) -> TowerOutput with
    embeddings [T / merge^2, out_hidden_size], images in grid order."""

    weight_map = WeightMap([
        (".mlp.gate_proj.", ".mlp.gate_up_proj.", 0),
        (".mlp.up_proj.", ".mlp.gate_up_proj.", 1),
        ("merger.mlp.0.", "merger.fc1.", None),
        ("merger.mlp.2.", "merger.fc2.", None),
    ])

    def __init__(self, config: Qwen2_5_VisionConfig, device=None, dtype=None):
        super().__init__(config, device, dtype)
        dim, dd = config.hidden_size, self.factory_kwargs
        self.full_attention = frozenset(config.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(config.patch_features, dim, bias=False, **dd)
        self.rotary = VisionRotary2D(config.head_dim, config.rope_theta, merge_size=self.merge)
        self.blocks = nn.ModuleList([
            VisionBlock(dim, config.num_heads, config.intermediate_size, norm="rms", norm_eps=config.norm_eps,
                        mlp="gated", act=config.hidden_act, prefix=f"blocks.{i}", **dd)
            for i in range(config.depth)])
        self.merger = PatchMerger(config.out_hidden_size, dim, self.merge, norm="rms", norm_eps=config.norm_eps, **dd)
        self._items = LRUCache(256)  # (t, h, w) -> window order, window lengths, positions (host)

    def _item(self, t: int, h: int, w: int):
        """One item's window order over merged tokens, window lengths (patches) and the patches'
        rotary positions in window order; host tensors, cached per (t, h, w)."""
        def make():
            unit = self.merge ** 2
            order, lengths = window_order(t, h, w, self.merge, self.config.merged_window)
            tokens = (order[:, None] * unit + torch.arange(unit)).reshape(-1)  # merged order -> patch order
            positions = self.rotary.frame_positions(h, w).repeat(t, 1)[tokens]
            return order, [n * unit for n in lengths], positions
        return self._items.get((t, h, w), make)

    def make_plan(self, grid: Grid, device) -> PackPlan:
        unit = self.merge ** 2
        orders, positions, window_lengths, offset = [], [], [], 0
        for t, h, w in grid:
            order, lengths, pos = self._item(t, h, w)
            orders.append(order + offset)
            positions.append(pos)
            window_lengths += lengths
            offset += t * h * w // unit
        merged_order = torch.cat(orders)  # [T / unit]
        token_order = (merged_order[:, None] * unit + torch.arange(unit)).reshape(-1)  # [T]
        # one host-to-device copy: [token order | inverse merged order | positions]
        packed = to_device(torch.cat([token_order, torch.argsort(merged_order), torch.cat(positions).reshape(-1)]), device)
        n = token_order.shape[0]
        token_order, merged_inverse, pos = packed[:n], packed[n:n + n // unit], packed[n + n // unit:].view(n, 2)
        cos, sin = self.rotary.cos_sin(pos)
        cu, max_len = make_cu_seqlens(frame_lengths(grid), device)
        cu_win, max_win = make_cu_seqlens(window_lengths, device)
        return PackPlan(n, cu, max_len, cos, sin, cu_window_seqlens=cu_win, max_window_seqlen=max_win,
                        token_order=token_order, merged_inverse=merged_inverse)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        plan = self.plan_for(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)[plan.token_order]  # [T, hidden], window order
        rotary = (plan.cos, plan.sin)
        for i, block in enumerate(self.blocks):
            if i in self.full_attention:
                x = block(x, plan.cu_seqlens, plan.max_seqlen, rotary)
            else:
                x = block(x, plan.cu_window_seqlens, plan.max_window_seqlen, rotary)
        return TowerOutput(self.merger(x)[plan.merged_inverse])  # [T / unit, out_hidden], image order


def _qwen2_5_vl_builtin(out_hidden: int) -> dict:
    vision = {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
              "in_chans": 3, "out_hidden_size": out_hidden, "patch_size": 14, "spatial_merge_size": 2,
              "spatial_patch_size": 14, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
              "tokens_per_second": 2, "temporal_patch_size": 2}
    return builtin_config("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", vision, hidden_size=out_hidden)


QWEN2_5_VL_SPEC = register_model(ModelSpec(
    architectures=("Qwen2_5_VLForConditionalGeneration",),
    vision_architectures=("Qwen2_5_VisionTransformerPretrainedModel",),
    tower_cls=Qwen2_5_VisionTower,
    config_from_hf=Qwen2_5_VisionConfig.from_hf,
    weight_prefixes=("model.visual.", "visual."),
    processor_from_hf=processor_for("qwen2_vl"),
    builtin_configs={
        "Qwen/Qwen2.5-VL-3B-Instruct": _qwen2_5_vl_builtin(2048),
        "Qwen/Qwen2.5-VL-7B-Instruct": _qwen2_5_vl_builtin(3584),
        "Qwen/Qwen2.5-VL-32B-Instruct": _qwen2_5_vl_builtin(5120),
        "Qwen/Qwen2.5-VL-72B-Instruct": _qwen2_5_vl_builtin(8192),
    },
))
