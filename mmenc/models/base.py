"""What every vision tower exposes, and how a tower family is registered.

A tower is an nn.Module built from a typed config:
    Tower(config, multimodal_config=None, device=None, dtype=None)
    forward(pixel_values [T, C*tp*p*p] float, grid_thw int64 [N, 3] on CPU) -> TowerOutput
    load_weights(weights: Iterable[(name, tensor)]) -> set of loaded parameter names
Tensor names in `load_weights` are the checkpoint's, with the family's tower prefix removed.
Model files name no platform and no backend: MMEncoderAttention decides.
"""
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

import torch


class TowerConfigBase:
    """Derived sizes and checks shared by the towers' typed configs (frozen dataclasses with
    num_heads, in_channels, temporal_patch_size, patch_size and a width field)."""

    width_field: ClassVar[str] = "hidden_size"  # the tower's width (Qwen2-VL calls it embed_dim)

    @property
    def head_dim(self) -> int:
        return getattr(self, self.width_field) // self.num_heads

    @property
    def patch_features(self) -> int:
        """Values per row of pixel_values: C * temporal_patch * patch * patch."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def check_positive(self, *fields: str) -> None:
        for field in fields:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}.{field}={value!r} must be a positive integer")

    def check_rotary_heads(self) -> None:
        """The width splits into num_heads heads whose size divides by 4 (2-D rotary)."""
        width = getattr(self, self.width_field)
        if width % self.num_heads or (width // self.num_heads) % 4:
            raise ValueError(f"{type(self).__name__}: {self.width_field}={width} must be num_heads={self.num_heads} "
                             f"times a head size divisible by 4 (2-D rotary)")


@dataclasses.dataclass
class TowerOutput:
    """embeddings [tokens, out_hidden] in image order; `extras` holds a family's further outputs
    (Qwen3-VL's deepstack features: "deepstack" -> list of [tokens, out_hidden]), same token order."""

    embeddings: torch.Tensor
    extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "TowerOutput":
        """A TowerOutput with `fn` applied to every tensor: embeddings, tensor extras and the tensors
        of list/tuple extras (other extras are passed through)."""
        def apply(value):
            if isinstance(value, torch.Tensor):
                return fn(value)
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
                return type(value)(fn(v) for v in value)
            return value
        return TowerOutput(embeddings=fn(self.embeddings), extras={k: apply(v) for k, v in self.extras.items()})


class VisionTower(Protocol):
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields (after merging)."""
        ...


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tower family as the registry knows it.

    architectures: checkpoint `architectures` strings this family serves.
    tower_cls: the tower nn.Module class.
    config_from_hf: full config.json dict -> the tower's typed config.
    weight_prefixes: checkpoint name prefixes of the tower's tensors, tried in order
        (e.g. "model.visual.", "visual."); stripped before load_weights.
    processor_from_hf: preprocessor_config.json dict (or {} for defaults) -> image processor.
    builtin_configs: name -> full config.json dict, for load_format="dummy" with no files.
    """

    architectures: tuple[str, ...]
    tower_cls: type
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    weight_prefixes: tuple[str, ...]
    processor_from_hf: Callable[[Mapping[str, Any]], Any]
    builtin_configs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
