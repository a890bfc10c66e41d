"""Building blocks shared by vision towers, all on the parallel linears and MMEncoderAttention.

Every block takes `device=None, dtype=None`. Its parallel linears shard over the tensor-parallel group
set when the block is built (`mmenc.distributed.parallel_state`; none set: unsharded, as in data mode).

  PatchEmbed       Conv3d/Conv2d with stride == kernel, as one matmul over flattened patches
  VisionAttention  QKVParallelLinear -> rotary -> MMEncoderAttention -> RowParallelLinear
  VisionMLP        fc1 (column) -> act -> fc2 (row)
  GatedVisionMLP   gate_up_proj (merged column) -> act(gate) * up -> down_proj (row)   (SwiGLU)
  VisionBlock      pre-norm residual block: x + attn(norm1(x)); x + mlp(norm2(x))
  PatchMerger      norm -> merge m x m neighbouring patches -> fc1 (column) -> GELU -> fc2 (row)

Names follow the Qwen-VL checkpoints where they can (attn.qkv, attn.proj, mlp.fc1, norm1, ...).
"""
import torch
import torch.nn as nn

from mmenc.attention import MMEncoderAttention
from mmenc.config import MultiModalConfig
from mmenc.layers.activation import ActAndMul, get_act_fn
from mmenc.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 ReplicatedLinear, RowParallelLinear)
from mmenc.layers.norm import make_norm
from mmenc.layers.rotary import apply_rotary


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
    Fixed-size towers pass a dense batch instead: x [B, S, dim] (each row attends to itself) with
    rotary tables [S, head_dim] shared by the rows -> [B, S, dim]; cu_seqlens None (MMEncoderAttention's
    dense form), or the rows' uniform segments from make_cu_seqlens([S] * B) made once per forward, which
    attend the same rows as one [1, B*S] view (what torch.compile traces: no host work in the layer).
    """

    def __init__(self, dim: int, num_heads: int, head_dim: int | None = None, qkv_bias: bool = True,
                 proj_bias: bool = True, rotary_interleaved: bool = False,
                 multimodal_config: MultiModalConfig | None = None, prefix: str = "", device=None, dtype=None):
        super().__init__()
        head_dim = dim // num_heads if head_dim is None else head_dim
        self.rotary_interleaved = rotary_interleaved
        self.qkv = QKVParallelLinear(dim, head_dim, num_heads, bias=qkv_bias, prefix=_join(prefix, "qkv"),
                                     device=device, dtype=dtype)
        self.num_heads, self.head_dim, self.local_heads = num_heads, head_dim, self.qkv.num_heads_per_rank
        self.attn = MMEncoderAttention(self.local_heads, head_dim, prefix=_join(prefix, "attn"),
                                       multimodal_config=multimodal_config, dtype=dtype, device=device)
        self.proj = RowParallelLinear(num_heads * head_dim, dim, bias=proj_bias, prefix=_join(prefix, "proj"),
                                      device=device, dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        lead = x.shape[:-1]  # (T,) packed or (B, S) dense
        qkv = self.qkv(x).view(*lead, 3, self.local_heads, self.head_dim)  # [..., 3, H, D]
        if rotary is not None:
            qk = qkv[..., :2, :, :] if x.dim() == 2 else qkv[..., :2, :, :].transpose(0, 1)  # token dim first
            qk = apply_rotary(qk, *rotary, interleaved=self.rotary_interleaved)  # [T | S (, B), 2, H, D]
            q, k = (qk if x.dim() == 2 else qk.transpose(0, 1)).unbind(-3)
        else:
            q, k = qkv[..., 0, :, :], qkv[..., 1, :, :]
        v = qkv[..., 2, :, :]
        if x.dim() == 2:  # packed: one sequence of T tokens split by cu_seqlens
            q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
        elif cu_seqlens is not None:  # dense rows as equal segments of one sequence (views)
            q, k, v = (t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v))
        out = self.attn(q, k, v, cu_seqlens, max_seqlen)  # [B, S, H, D]
        return self.proj(out.reshape(*lead, self.local_heads * self.head_dim))


class VisionMLP(nn.Module):
    """fc1 -> act -> fc2; x [T, dim] -> [T, dim]."""

    def __init__(self, dim: int, hidden: int, act: str = "gelu", bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        super().__init__()
        self.fc1 = ColumnParallelLinear(dim, hidden, bias=bias, prefix=_join(prefix, "fc1"), device=device,
                                        dtype=dtype)
        self.act = get_act_fn(act)
        self.fc2 = RowParallelLinear(hidden, dim, bias=bias, prefix=_join(prefix, "fc2"), device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)) with gate and up in one merged matmul (gate_up_proj,
    shards 0 and 1); x [T, dim] -> [T, dim]."""

    def __init__(self, dim: int, hidden: int, act: str = "silu", bias: bool = True, prefix: str = "",
                 device=None, dtype=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(dim, [hidden, hidden], bias=bias,
                                                       prefix=_join(prefix, "gate_up_proj"), device=device,
                                                       dtype=dtype)
        self.act_and_mul = ActAndMul(act)
        self.down_proj = RowParallelLinear(hidden, dim, bias=bias, prefix=_join(prefix, "down_proj"), device=device,
                                           dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x)).

    norm: "rms" or "layer"; mlp: "gated" (GatedVisionMLP) or "plain" (VisionMLP).
    forward(x [T, dim], cu_seqlens, max_seqlen, rotary) -> [T, dim]; or dense x [B, S, dim] with
    cu_seqlens None (see VisionAttention).
    """

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, *, norm: str = "rms", norm_eps: float = 1e-6,
                 mlp: str = "gated", act: str = "silu", qkv_bias: bool = True, mlp_bias: bool = True,
                 head_dim: int | None = None, rotary_interleaved: bool = False,
                 multimodal_config: MultiModalConfig | None = None, prefix: str = "", device=None, dtype=None):
        super().__init__()
        self.norm1 = make_norm(norm, dim, norm_eps, device=device, dtype=dtype)
        self.norm2 = make_norm(norm, dim, norm_eps, device=device, dtype=dtype)
        self.attn = VisionAttention(dim, num_heads, head_dim, qkv_bias=qkv_bias, proj_bias=qkv_bias,
                                    rotary_interleaved=rotary_interleaved, multimodal_config=multimodal_config,
                                    prefix=_join(prefix, "attn"), device=device, dtype=dtype)
        mlps = {"gated": GatedVisionMLP, "plain": VisionMLP}
        if mlp not in mlps:
            raise ValueError(f"mlp kind {mlp!r} is not known; expected 'gated' or 'plain'")
        self.mlp = mlps[mlp](dim, mlp_hidden, act=act, bias=mlp_bias, prefix=_join(prefix, "mlp"), device=device,
                             dtype=dtype)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None, max_seqlen: int | None,
                rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, max_seqlen, rotary)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Merges each merge_size x merge_size block of neighbouring patches into one output token.

    The input holds a block's patches contiguously (merge-block order). forward(x [T, context_dim])
    -> [T / merge_size^2, out_dim]. The norm runs on each patch (context_dim), or with
    norm_after_merge=True on the merged vector (Qwen3-VL's post-shuffle norm).
    Parameters: ln_q, fc1 (column-parallel), fc2 (row-parallel).
    """

    def __init__(self, out_dim: int, context_dim: int, merge_size: int = 2, *, norm: str = "rms",
                 norm_eps: float = 1e-6, act: str = "gelu", norm_after_merge: bool = False,
                 prefix: str = "merger", device=None, dtype=None):
        super().__init__()
        self.hidden = context_dim * merge_size ** 2
        self.norm_after_merge = norm_after_merge
        self.ln_q = make_norm(norm, self.hidden if norm_after_merge else context_dim, norm_eps,
                              device=device, dtype=dtype)
        self.fc1 = ColumnParallelLinear(self.hidden, self.hidden, bias=True, prefix=_join(prefix, "fc1"),
                                        device=device, dtype=dtype)
        self.act = get_act_fn(act)
        self.fc2 = RowParallelLinear(self.hidden, out_dim, bias=True, prefix=_join(prefix, "fc2"), device=device,
                                     dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.norm_after_merge:
            x = self.ln_q(x.reshape(-1, self.hidden))
        else:
            x = self.ln_q(x).reshape(-1, self.hidden)  # [T, C] -> [T / m^2, C * m^2]
        return self.fc2(self.act(self.fc1(x)))
