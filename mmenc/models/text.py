"""Text towers of the contrastive image-text models (CLIP, SigLIP, SigLIP2): texts in the image embeddings' space.

    tower = TextTower(TextConfig.from_hf(config_json))
    tower.load_weights(named tensors under TEXT_PREFIXES)           # transformers' names
    vectors = tower(input_ids [B, L] int64, attention_mask [B, L] or None) -> [B, projection]

Per text (transformers' CLIPTextModel / SiglipTextModel, then the projection):
  token embedding + learned positions (0 .. L-1);
  pre-norm LayerNorm blocks (q/k/v/out projections with bias, plain MLP: quick_gelu for CLIP, gelu-tanh
  for SigLIP), attention causal for CLIP and bidirectional for SigLIP, padded keys masked where an
  attention_mask is given; final_layer_norm;
  pooled: CLIP the end-of-text token (the first eos_token_id; the largest id where eos_token_id is 2, as
  transformers keeps for old configs) -> text_projection (no bias); SigLIP the last position -> head.
Attention here is plain PyTorch (float32 softmax over [B, H, L, L]): text sequences are at most 77 / 64
tokens and need masks (causal, padding) that the packed encoder attention does not take.
"""
import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn as nn

from mmenc.layers.activation import get_act_fn
from mmenc.layers.linear import ReplicatedLinear
from mmenc.layers.norm import LayerNorm
from mmenc.layers.weights import WeightMap, load_named_weights

# text_config.model_type -> tower kind
TEXT_KINDS = {"clip_text_model": "clip", "siglip_text_model": "siglip", "siglip2_text_model": "siglip"}
# checkpoint prefixes of the text tower (and CLIP's projection beside it: "text_projection." read as "projection.")
TEXT_PREFIXES = (("text_model.", "text_"), "text_model.")


@dataclasses.dataclass(frozen=True)
class TextConfig:
    """A contrastive model's text_config (plus CLIP's top-level projection_dim). kind: "clip" or "siglip";
    projection: the output width (CLIP projection_dim, SigLIP projection_size or hidden_size);
    eos_token_id: where CLIP pools (unused by SigLIP); max_positions: the longest text in tokens."""

    kind: str
    vocab_size: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    depth: int
    max_positions: int
    hidden_act: str
    layer_norm_eps: float
    projection: int
    eos_token_id: int = 2

    def __post_init__(self):
        if self.kind not in ("clip", "siglip"):
            raise ValueError(f"TextConfig.kind={self.kind!r}; expected 'clip' or 'siglip'")
        for name in ("vocab_size", "hidden_size", "num_heads", "intermediate_size", "depth", "max_positions",
                     "projection"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"TextConfig.{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"TextConfig: hidden_size={self.hidden_size} is not divisible by "
                             f"num_heads={self.num_heads}; expected a divisor")

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]) -> "TextConfig":
        """From a full config.json dict (CLIPModel, SiglipModel, Siglip2Model); ValueError naming what is
        missing for any other."""
        text = config.get("text_config")
        model_type = text.get("model_type") if isinstance(text, Mapping) else None
        if model_type not in TEXT_KINDS:
            archs = "/".join(config.get("architectures") or ["this checkpoint"])
            raise ValueError(f"{archs} has no text tower mmenc runs (text_config.model_type={model_type!r}); text "
                             f"embeddings need a contrastive image-text checkpoint: CLIPModel, SiglipModel or "
                             f"Siglip2Model (model_type one of {sorted(TEXT_KINDS)})")
        kind = TEXT_KINDS[model_type]
        clip = kind == "clip"
        hidden = int(text.get("hidden_size", 512 if clip else 768))
        eos = text.get("eos_token_id", 49407 if clip else 2)
        projection = (config.get("projection_dim") or text.get("projection_dim") or 512) if clip else \
            (text.get("projection_size") or hidden)
        return cls(kind=kind, vocab_size=int(text.get("vocab_size", 49408 if clip else 32000)), hidden_size=hidden,
                   num_heads=int(text.get("num_attention_heads", 8 if clip else 12)),
                   intermediate_size=int(text.get("intermediate_size", 2048 if clip else 3072)),
                   depth=int(text.get("num_hidden_layers", 12)),
                   max_positions=int(text.get("max_position_embeddings", 77 if clip else 64)),
                   hidden_act=text.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"),
                   layer_norm_eps=float(text.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
                   projection=int(projection), eos_token_id=int(eos[0] if isinstance(eos, list) else eos))


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """q, k, v [B, H, L, D], bias float32 [B, 1, L, L] (0 or -inf) -> [B, H, L, D]; float32 softmax."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)


class TextBlock(nn.Module):
    """x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x)); x [B, L, D] (transformers' parameter names)."""

    def __init__(self, config: TextConfig, device=None, dtype=None):
        super().__init__()
        dim, dd = config.hidden_size, {"device": device, "dtype": dtype}
        self.heads = config.num_heads
        self.layer_norm1 = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.layer_norm2 = LayerNorm(dim, config.layer_norm_eps, **dd)
        self.self_attn = nn.Module()
        for name in ("q_proj", "k_proj", "v_proj", "out_proj"):
            setattr(self.self_attn, name, ReplicatedLinear(dim, dim, bias=True, prefix=f"self_attn.{name}", **dd))
        self.mlp = nn.Module()
        self.mlp.fc1 = ReplicatedLinear(dim, config.intermediate_size, bias=True, prefix="mlp.fc1", **dd)
        self.mlp.act = get_act_fn(config.hidden_act)
        self.mlp.fc2 = ReplicatedLinear(config.intermediate_size, dim, bias=True, prefix="mlp.fc2", **dd)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        h = self.layer_norm1(x)
        q, k, v = (getattr(self.self_attn, n)(h).view(b, length, self.heads, -1).transpose(1, 2)
                   for n in ("q_proj", "k_proj", "v_proj"))
        x = x + self.self_attn.out_proj(_attention(q, k, v, bias).transpose(1, 2).reshape(b, length, dim))
        return x + self.mlp.fc2(self.mlp.act(self.mlp.fc1(self.layer_norm2(x))))


class TextTower(nn.Module):
    """See the module docstring. Parameters carry transformers' names under text_model (CLIP's
    text_projection as `projection`, SigLIP's head as `head`)."""

    weight_map = WeightMap()

    def __init__(self, config: TextConfig, device=None, dtype=None):
        super().__init__()
        dim, dd = config.hidden_size, {"device": device, "dtype": dtype}
        self.config = config
        self.embeddings = nn.Module()
        self.embeddings.token_embedding = nn.Embedding(config.vocab_size, dim, **dd)
        self.embeddings.position_embedding = nn.Embedding(config.max_positions, dim, **dd)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList([TextBlock(config, **dd) for _ in range(config.depth)])
        self.final_layer_norm = LayerNorm(dim, config.layer_norm_eps, **dd)
        if config.kind == "clip":
            self.projection = ReplicatedLinear(dim, config.projection, bias=False, prefix="projection", **dd)
        else:
            self.head = ReplicatedLinear(dim, config.projection, bias=True, prefix="head", **dd)
        for p in self.parameters():
            p.requires_grad_(False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_named_weights(self, weights, self.weight_map)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids int64 [B, L] (L <= max_positions), attention_mask [B, L] (1: a token, 0: padding) or
        None -> [B, projection] in the tower's dtype."""
        b, length = input_ids.shape
        if length > self.config.max_positions:
            raise ValueError(f"input_ids has {length} tokens; this text tower takes at most "
                             f"{self.config.max_positions} (tokenize with truncation=True)")
        positions = torch.arange(length, device=input_ids.device)
        x = self.embeddings.token_embedding(input_ids) + self.embeddings.position_embedding(positions)
        allowed = torch.ones(b, 1, length, length, dtype=torch.bool, device=input_ids.device)
        if self.config.kind == "clip":
            allowed = allowed.tril()
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        bias = torch.zeros(allowed.shape, device=x.device).masked_fill_(~allowed, -math.inf)
        for layer in self.encoder.layers:
            x = layer(x, bias)
        x = self.final_layer_norm(x)
        rows = torch.arange(b, device=x.device)
        if self.config.kind == "siglip":
            return self.head(x[:, -1])
        if self.config.eos_token_id == 2:  # transformers' rule for configs written before its eos fix
            pooled = x[rows, input_ids.argmax(-1)]
        else:
            pooled = x[rows, (input_ids == self.config.eos_token_id).int().argmax(-1)]
        return self.projection(pooled)
