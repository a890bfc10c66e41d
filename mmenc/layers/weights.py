"""Checkpoint names -> tower parameters: a small rename table and the loop that applies weight loaders.

A tower lists how its checkpoint names differ from its parameter names as `WeightMap` rules,
(checkpoint fragment, parameter fragment, shard id); e.g. Qwen2.5-VL's separate gate/up projections
land in one merged parameter:
    WeightMap([(".mlp.gate_proj.", ".mlp.gate_up_proj.", 0), (".mlp.up_proj.", ".mlp.gate_up_proj.", 1)])
`load_named_weights` then copies each tensor through its parameter's `weight_loader` (set by the
parallel linears, so a tensor-parallel rank copies only its slice), or a plain copy.
"""
import dataclasses
from collections.abc import Iterable, Sequence

import torch
import torch.nn as nn

Rule = tuple[str, str, "int | str | None"]

# transformers' SigLIP / CLIP-style encoder layer names -> VisionBlock's (norm1/norm2, fused qkv, proj)
SIGLIP_ENCODER_RULES: tuple[Rule, ...] = (
    (".layer_norm1.", ".norm1.", None),
    (".layer_norm2.", ".norm2.", None),
    (".self_attn.q_proj.", ".attn.qkv.", "q"),
    (".self_attn.k_proj.", ".attn.qkv.", "k"),
    (".self_attn.v_proj.", ".attn.qkv.", "v"),
    (".self_attn.out_proj.", ".attn.proj.", None),
)


@dataclasses.dataclass(frozen=True)
class WeightMap:
    """Rename rules; the first rule whose checkpoint fragment occurs in a name applies (once)."""

    rules: Sequence[Rule] = ()

    def to_param(self, name: str) -> tuple[str, "int | str | None"]:
        """checkpoint name (tower prefix removed) -> (parameter name, shard id or None)."""
        for ckpt, param, shard in self.rules:
            if ckpt in name:
                return name.replace(ckpt, param, 1), shard
        return name, None

    def shards(self, param_name: str) -> list[tuple[str, "int | str | None"]]:
        """[(checkpoint name, shard id)] that together fill `param_name`."""
        found = [(param_name.replace(param, ckpt, 1), shard) for ckpt, param, shard in self.rules
                 if param in param_name]
        return found or [(param_name, None)]

    def checkpoint_names(self, param_name: str) -> list[str]:
        return [name for name, _ in self.shards(param_name)]


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id=None) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"tensor has shape {tuple(loaded.shape)}; expected {tuple(param.shape)}")
    param.data.copy_(loaded)


class LoadedWeights(set):
    """The names of fully loaded parameters; `shards_seen` maps every touched parameter to the shard
    ids that arrived, so a caller can name exactly which checkpoint tensor of a merged one is missing."""

    def __init__(self, names=(), shards_seen: dict[str, set] | None = None):
        super().__init__(names)
        self.shards_seen = shards_seen or {}


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       weight_map: WeightMap = WeightMap()) -> LoadedWeights:
    """Copy checkpoint tensors (names relative to the tower) into `module`'s parameters.

    Returns the names of parameters now fully loaded (a merged parameter counts once all its shards
    arrived). Raises ValueError naming the checkpoint tensor when it matches no parameter or its
    shape is not the expected one.
    """
    params = dict(module.named_parameters())
    seen: dict[str, set] = {}
    for name, tensor in weights:
        target, shard = weight_map.to_param(name)
        param = params.get(target)
        if param is None:
            renamed = f" (renamed {target!r})" if target != name else ""
            raise ValueError(f"checkpoint tensor {name!r}{renamed} matches no parameter of "
                             f"{type(module).__name__}; is the checkpoint for another model or tower size?")
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            param_desc = f"parameter {target!r} of " if target != name else ""
            raise ValueError(f"checkpoint tensor {name!r} does not fit {param_desc}{type(module).__name__}: {e}") from e
        seen.setdefault(target, set()).add(shard)
    complete = [p for p, got in seen.items() if {s for _, s in weight_map.shards(p)} <= got]
    return LoadedWeights(complete, seen)

