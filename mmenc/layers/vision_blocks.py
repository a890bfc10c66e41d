"""Building blocks shared by vision towers, all on the parallel linears and MMEncoderAttention.

Every block takes `device=None, dtype=None`. Its parallel linears shard over the tensor-parallel group
set when the block is built (`mmenc.distributed.parallel_state`; none set: unsharded, as in data mode).

  PatchEmbed       Conv3d/Conv2d with stride == kernel, as one matmul over flattened patches
  VisionAttention  QKVParallelLinear -> [per-head RMSNorm of q, k] -> rotary -> MMEncoderAttention
                   -> RowParallelLinear
  VisionMLP        fc1 (column) -> act -> fc2 (row)
  GatedVisionMLP   gate_up_proj (merged column) -> act(gate) * up -> down_proj (row)   (SwiGLU)
  VisionBlock      pre-norm residual block: x + attn(norm1(x)); x + mlp(norm2(x)) (optionally
                   with a learned per-channel layer scale on each branch, InternViT's lambda_1/2)
  PatchMerger      norm -> merge m x m neighbouring patches -> fc1 (column) -> GELU -> fc2 (row)

Attention and blocks take x [T, dim] (packed, with cu_seqlens) or [B, S, dim] (a dense batch of B
equal-length sequences, cu_seqlens=None: fixed-size towers).

Names follow the Qwen-VL checkpoints where they can (attn.qkv, attn.proj, mlp.fc1, norm1, ...).
"""
import torch
import torch.nn as nn

from mmenc.attention import MMEncoderAttention
from mmenc.backends.linear.fp8 import QuantizedRows
from mmenc.layers import fused
from mmenc.layers.activation import ActAndMul, activation_kind, get_act_fn
from mmenc.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 ReplicatedLinear, RowParallelLinear)
from mmenc.layers.norm import RMSNorm, ShardedRMSNorm, make_norm
from mmenc.layers.rotary import apply_rotary
from mmenc.layers.row_blocks import MAX_INTERMEDIATE_BYTES, flat_rows, num_row_blocks, split_rows


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


class PatchEmbed(nn.Module):
    """A convolution whose stride equals its kernel, run as one matmul: each row of pixel_values is one
    flattened patch (C, [tp,] p, p) and becomes one token.

    forward(pixel_values [T, in_features]) -> [T, embed_dim] in the weight's dtype.
    `proj.weight` [embed_dim, in_features] loads the checkpoint's conv weight [embed_dim, C, (tp,) p, p]
    by reshaping.
    """

    def __init__(self, in_features: int, embed_dim: int, bias: bool = False, prefix: str = "patch_embed",
                 device=None, dtype=None):
        super().__init__()
        self.in_features, self.embed_dim = in_features, embed_dim
        self.proj = ReplicatedLinear(in_features, embed_dim, bias=bias, prefix=_join(prefix, "proj"), device=device,
                                     dtype=dtype)
        self.proj.weight.weight_loader = self._load_conv_weight

    def _load_conv_weight(self, param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.dim() < 2 or loaded.shape[0] != self.embed_dim or loaded[0].numel() != self.in_features:
            raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected a convolution weight "
                             f"[{self.embed_dim}, ...] with {self.in_features} values per output channel "
                             f"(as a matmul: {tuple(param.shape)})")
        param.data.copy_(loaded.reshape(param.shape))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        if pixel_values.dim() != 2 or pixel_values.shape[-1] != self.in_features:
            raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; expected [patches, "
                             f"{self.in_features}] (one flattened patch per row)")
        return self.proj(pixel_values.to(self.proj.weight.dtype))


class VisionAttention(nn.Module):
    """Multi-head self-attention over packed tokens, heads split over tensor-parallel ranks.

    forward(x [T, dim], cu_seqlens int32 [N+1], max_seqlen int, rotary=(cos, sin) float32 [T, head_dim]
    or None) -> [T, dim]. The same cu_seqlens tensor (from make_cu_seqlens) should serve every layer.
    A dense batch x [B, S, dim] (fixed-size towers) attends within each of its B rows given
    cu_seqlens=None (MMEncoderAttention's dense form), or within the segments of cu_seqlens over its
    B*S tokens (the rows' uniform segments made once per grid: what torch.compile traces, no host work
    in the layer); its rotary tables are [S, head_dim], shared by the rows.
    qk_norm: RMS-normalise q and k before the rotary (q_norm, k_norm, eps qk_norm_eps): "head", each
    head on its own ([head_dim] weights; GLM-OCR), or "all", all heads together ([heads*head_dim]
    weights, statistics summed over tensor-parallel ranks; InternViT-6B); None: no q/k norm.
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True,
                 proj_bias: bool = True, rotary_interleaved: bool = False, qk_norm: str | None = None,
                 qk_norm_eps: float = 1e-6, prefix: str = "", device=None, dtype=None):
        super().__init__()
        head_dim = dim // num_heads if head_dim is None else head_dim
        self.rotary_interleaved = rotary_interleaved
        self.qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=qkv_bias, prefix=_join(prefix, "qkv"),
                                     device=device, dtype=dtype)
        self.num_heads, self.head_dim, self.local_heads = num_heads, head_dim, self.qkv.num_heads_per_rank
        self.attn = MMEncoderAttention(self.local_heads, head_dim, prefix=_join(prefix, "attn"), dtype=dtype,
                                       device=device)
        self.proj = RowParallelLinear(num_heads * head_dim, dim, bias=proj_bias, prefix=_join(prefix, "proj"),
                                      device=device, dtype=dtype)
        if qk_norm not in (None, "head", "all"):
            raise ValueError(f"{prefix or 'VisionAttention'}: qk_norm={qk_norm!r}; expected None, 'head' or 'all'")
        self.qk_norm, self.q_norm, self.k_norm = qk_norm, None, None
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, device=device, dtype=dtype)
        elif qk_norm == "all":
            width, shard = num_heads * head_dim, self.local_heads * head_dim
            self.q_norm = ShardedRMSNorm(width, shard, qk_norm_eps, device=device, dtype=dtype)
            self.k_norm = ShardedRMSNorm(width, shard, qk_norm_eps, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        lead = (x.data if isinstance(x, QuantizedRows) else x).shape[:-1]  # (T,) packed or (B, S) dense
        qkv = self.qkv(x).view(*lead, 3, self.local_heads, self.head_dim)  # [..., 3, H, D]
        v = qkv[..., 2, :, :]  # [..., H, D]
        if self.qk_norm is not None and rotary is None:  # q, k normalised into two tensors of their own (no
            q, k = self._normed(qkv[..., 0, :, :]), self._normed(qkv[..., 1, :, :], key=True)  # stacked copy)
        else:
            qk = qkv[..., :2, :, :]  # [..., 2, H, D]
            if self.qk_norm is not None:
                qk = torch.stack([self._normed(qk[..., 0, :, :]), self._normed(qk[..., 1, :, :], key=True)], dim=-3)
            if rotary is not None:  # cos, sin [T, D] packed, or [S, D] shared by a dense batch's rows
                dense = len(lead) == 2
                qk = apply_rotary(qk.transpose(0, 1) if dense else qk, *rotary, interleaved=self.rotary_interleaved)
                qk = qk.transpose(0, 1) if dense else qk  # token dim first for the tables, then back
            q, k = qk.unbind(-3)
        if len(lead) == 1 or cu_seqlens is not None:  # packed: [T, ...] or [B, S, ...] -> [1, T, ...]
            q, k, v = (t.reshape(1, -1, self.local_heads, self.head_dim) for t in (q, k, v))
        out = self.attn(q, k, v, cu_seqlens, max_seqlen)  # [1, T, H, D] or [B, S, H, D]
        return self.proj(out.reshape(*lead, self.local_heads * self.head_dim))

    def _normed(self, x: torch.Tensor, key: bool = False) -> torch.Tensor:
        """q (or k with key=True) [..., H, D] through q_norm (k_norm): per head, or over all heads."""
        norm = self.k_norm if key else self.q_norm
        if self.qk_norm == "head":
            return norm(x)
        return norm(x.flatten(-2)).unflatten(-1, (self.local_heads, self.head_dim))


class VisionMLP(nn.Module):
    """fc1 -> act -> fc2; x [T, dim] -> [T, dim]. fused_kernels (mmenc.layers.fused.use_fused_kernels): the
    activation as a fused kernel, quantizing fc2's input where fc2 runs FP8."""

    fused_kernels = False

    def __init__(self, dim: int, hidden: int, act: str = "gelu", bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, bias=bias, prefix=_join(prefix, "fc1"), device=device,
                                        dtype=dtype)
        self.act = get_act_fn(act)
        self.fc2 = RowParallelLinear(hidden, dim, bias=bias, prefix=_join(prefix, "fc2"), device=device, dtype=dtype)

    @property
    def intermediate_width(self) -> int:
        """Features of the widest intermediate per token (fc1's output on this rank)."""
        return self.fc1.weight.shape[0]

    @property
    def input_linear(self) -> nn.Module:
        return self.fc1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fuses = self.fc1.linear_backend is not None and activation_kind(self.act) in self.fc1.linear_backend.fused_activations
        if self.fused_kernels and not fuses:
            return self.fc2(fused.linear_then_act(self.fc1, self.act, x, gated=False, consumer=self.fc2))
        return self.fc2(self.fc1.forward_activated(x, self.act))


class GatedVisionMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with gate and up in one merged matmul (gate_up_proj,
    shards 0 and 1); x [T, dim] -> [T, dim]. fused_kernels: act(gate) * up as one kernel reading the merged
    output once, quantizing down_proj's input where down_proj runs FP8."""

    fused_kernels = False

    def __init__(self, dim: int, hidden: int, act: str = "silu", bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], bias=bias,
                                                       prefix=_join(prefix, "gate_up_proj"), device=device,
                                                       dtype=dtype)
        self.act_and_mul = ActAndMul(act)
        self.down_proj = RowParallelLinear(hidden, dim, bias=bias, prefix=_join(prefix, "down_proj"), device=device,
                                           dtype=dtype)

    @property
    def intermediate_width(self) -> int:
        """Features of the widest intermediate per token (gate_up_proj's output on this rank)."""
        return self.gate_up_proj.weight.shape[0]

    @property
    def input_linear(self) -> nn.Module:
        return self.gate_up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_kernels:
            return self.down_proj(fused.linear_then_act(self.gate_up_proj, self.act_and_mul.act, x, gated=True,
                                                        consumer=self.down_proj))
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)).

    norm: "rms" or "layer"; mlp: "gated" (GatedVisionMLP) or "plain" (VisionMLP); proj_bias: the
    attention output's bias (default: as qkv_bias); layer_scale: x + ls1 * attn(...), x + ls2 * mlp(...)
    with learned per-channel scales ls1, ls2 [dim]; qk_norm, qk_norm_eps: see VisionAttention.
    forward(x [T, dim] or [B, S, dim], cu_seqlens (None for [B, S, dim]), max_seqlen, rotary) -> x's shape.
    max_intermediate_bytes: when the MLP's hidden activations (2 x [tokens, mlp width]) would take more bytes,
    the MLP branch (norm2 -> MLP -> residual add) runs over row blocks, each added into its rows of the
    residual in place (mmenc.layers.row_blocks; None: never split).
    fused_kernels (mmenc.layers.fused.use_fused_kernels): the residual add and norm2 in one kernel, and
    each norm quantizing its output where the linear reading it runs FP8; off: the reference ops.
    """

    fused_kernels = False

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, *, norm: str = "rms", norm_eps: float = 1e-6,
                 mlp: str = "gated", act: str = "silu", qkv_bias: bool = True, mlp_bias: bool = True,
                 proj_bias: bool | None = None, head_dim: int | None = None, rotary_interleaved: bool = False,
                 layer_scale: bool = False, qk_norm: str | None = None, qk_norm_eps: float = 1e-6,
                 max_intermediate_bytes: int | None = MAX_INTERMEDIATE_BYTES, prefix: str = "", device=None,
                 dtype=None):
        super().__init__()
        self.max_intermediate_bytes = max_intermediate_bytes
        self.norm1 = make_norm(norm, dim, norm_eps, device=device, dtype=dtype)
        self.norm2 = make_norm(norm, dim, norm_eps, device=device, dtype=dtype)
        self.attn = VisionAttention(dim, num_heads, head_dim, qkv_bias=qkv_bias,
                                    proj_bias=qkv_bias if proj_bias is None else proj_bias,
                                    rotary_interleaved=rotary_interleaved, qk_norm=qk_norm, qk_norm_eps=qk_norm_eps,
                                    prefix=_join(prefix, "attn"), device=device, dtype=dtype)
        mlps = {"gated": GatedVisionMLP, "plain": VisionMLP}
        if mlp not in mlps:
            raise ValueError(f"mlp kind {mlp!r} is not known; expected 'gated' or 'plain'")
        self.mlp = mlps[mlp](dim, mlp_hidden, act=act, bias=mlp_bias, prefix=_join(prefix, "mlp"), device=device,
                             dtype=dtype)
        self.ls1 = self.ls2 = None
        if layer_scale:
            self.ls1 = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)
            self.ls2 = nn.Parameter(torch.ones(dim, device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        if self.fused_kernels:
            return self._fused_forward(x, cu_seqlens, max_seqlen, rotary)
        attn = self.attn(self.norm1(x), cu_seqlens, max_seqlen, rotary)
        # attn is the projection's fresh output: x added into it (the same bits as x + attn), no new tensor
        x = attn.add_(x) if self.ls1 is None else torch.addcmul(x, self.ls1, attn)  # one kernel: x + ls1 * attn
        del attn  # eager: not held through the MLP
        return self._mlp_branch(x)

    def _fused_forward(self, x, cu_seqlens, max_seqlen, rotary) -> torch.Tensor:
        """forward with the fused row kernels (mmenc.layers.fused): the same arithmetic, fewer passes."""
        attn = self.attn(fused.norm(self.norm1, x, self.attn.qkv), cu_seqlens, max_seqlen, rotary)
        blocks = num_row_blocks(x.shape[:-1].numel(), 2 * self.mlp.intermediate_width * x.element_size(),
                                self.max_intermediate_bytes)
        if self.ls1 is not None or blocks > 1:
            return self._mlp_branch(x + attn if self.ls1 is None else torch.addcmul(x, self.ls1, attn))
        h, x = fused.add_norm(self.norm2, x, attn, self.mlp.input_linear)
        del attn
        mlp = self.mlp(h)
        return x + mlp if self.ls2 is None else torch.addcmul(x, self.ls2, mlp)

    def _mlp_branch(self, x: torch.Tensor) -> torch.Tensor:
        """x + (ls2 *) mlp(norm2(x)), over row blocks in place when the MLP's intermediates are large."""
        # eager holds the MLP's first output and the activation's at once: 2 x its width per token
        blocks = num_row_blocks(x.shape[:-1].numel(), 2 * self.mlp.intermediate_width * x.element_size(),
                                self.max_intermediate_bytes)
        if blocks > 1:  # x is this block's own tensor: each row block gets its MLP branch added in place
            for rows in split_rows(flat_rows(x), blocks):
                self._add_mlp_(rows)
            return x
        mlp = self.mlp(self.norm2(x))
        return mlp.add_(x) if self.ls2 is None else torch.addcmul(x, self.ls2, mlp)  # mlp: fresh, as attn above

    def _add_mlp_(self, x: torch.Tensor) -> None:
        """x [rows, dim] += (ls2 *) mlp(norm2(x)), in place: the same arithmetic as forward's last line."""
        mlp = self.mlp(self.norm2(x))
        if self.ls2 is None:
            x.add_(mlp)
        else:
            x.addcmul_(self.ls2, mlp)


class PatchMerger(nn.Module):
    """Merges each merge_size x merge_size block of neighbouring patches into one output token.

    The input holds a block's patches contiguously (merge-block order). forward(x [T, context_dim])
    -> [T / merge_size^2, out_dim]. The norm runs on each patch (context_dim), or with
    norm_after_merge=True on the merged vector (Qwen3-VL's post-shuffle norm, InternVL's projector).
    Parameters: ln_q, fc1 (column-parallel, to mid_dim: default the merged width), fc2 (row-parallel).
    """

    def __init__(self, out_dim: int, context_dim: int, merge_size: int = 2, *, norm: str = "rms",
                 norm_eps: float = 1e-6, act: str = "gelu", norm_after_merge: bool = False,
                 mid_dim: int | None = None, prefix: str = "merger", device=None, dtype=None):
        super().__init__()
        self.hidden = context_dim * merge_size ** 2
        self.norm_after_merge = norm_after_merge
        self.ln_q = make_norm(norm, self.hidden if norm_after_merge else context_dim, norm_eps,
                              device=device, dtype=dtype)
        mid_dim = self.hidden if mid_dim is None else mid_dim
        self.fc1 = ColumnParallelLinear(self.hidden, mid_dim, bias=True, prefix=_join(prefix, "fc1"),
                                        device=device, dtype=dtype)
        self.act = get_act_fn(act)
        self.fc2 = RowParallelLinear(mid_dim, out_dim, bias=True, prefix=_join(prefix, "fc2"), device=device,
                                     dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            x = self.ln_q(x.reshape(-1, self.hidden))
        else:
            x = self.ln_q(x).reshape(-1, self.hidden)  # [T, C] -> [T / m^2, C * m^2]
        return self.fc2(self.act(self.fc1(x)))
