"""The tower base: what every vision tower shares, written once; and how a family is registered.

A family file holds only its own math: a typed config (a frozen dataclass on `TowerConfigBase`,
with an alias table for its checkpoints' key names), the modules its tower builds, `make_plan`
(what a forward derives from the grid) and `forward`. `VisionTower` owns the rest:
    Tower(config, device=None, dtype=None)
    forward(pixel_values [T, C*tp*p*p] float, grid_thw int64 [N, 3] on CPU) -> TowerOutput
    plan(grid_thw, device) -> the family's plan, cached per (grid, device)
    output_tokens(grid_thw) -> embedding rows per image
    load_weights(weights: Iterable[(name, tensor)]) -> set of loaded parameter names
Tensor names in `load_weights` are the checkpoint's, with the family's tower prefix removed.
Tensor parallelism is read from mmenc.distributed.parallel_state by the parallel linears when a
tower is built, and the MultiModalConfig (attention backend, custom ops, batch invariance) by the
attention layers from the build context build_tower sets (mmenc.config); no tower or block takes a
tp size or a config of how it runs. Model files name no platform and no backend.
"""
import dataclasses
import functools
import importlib
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn as nn

from mmenc.layers.grid import Grid, read_grid
from mmenc.layers.linear_kernels import linear_plan, prepare_plan, restore_linears
from mmenc.layers.weights import WeightMap, load_named_weights
from mmenc.utils.lru import LRUCache


def vlm_config_dict(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The part of a config.json dict that holds `vision_config` and `text_config`: the dict itself, or
    its `thinker_config` (Qwen-Omni checkpoints nest the vision-language model there)."""
    thinker = config.get("thinker_config")
    return thinker if "vision_config" not in config and isinstance(thinker, Mapping) else config


def vision_config_dict(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `vision_config` of a full config.json dict (see vlm_config_dict), or the dict itself when it
    is a vision config (it has neither `architectures` nor `text_config`, or it is a vision model's own
    config.json: model_type "..._vision_model", e.g. CLIPVisionModel's)."""
    config = vlm_config_dict(config)
    if "vision_config" not in config:
        own = str(config.get("model_type", "")).endswith("_vision_model") and "text_config" not in config
        if ("architectures" in config or "text_config" in config) and not own:
            archs = ", ".join(config.get("architectures") or []) or "(no architectures listed)"
            raise ValueError(f"config.json of {archs} has no 'vision_config'; expected the config.json of a "
                             f"vision-language checkpoint, whose 'vision_config' describes the tower (or that "
                             f"vision config alone)")
        return dict(config)
    vision = config["vision_config"]
    if not isinstance(vision, Mapping):
        raise ValueError(f"config.json 'vision_config' is {type(vision).__name__}; expected a mapping")
    return dict(vision)


def language_width(config: Mapping[str, Any]) -> int | None:
    """The language model's hidden size in a full config.json dict: text_config.hidden_size, or the
    top-level hidden_size of a flat config (text keys at the root beside vision_config); None for a
    vision config alone or when neither is given."""
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get("hidden_size"):
        return int(text["hidden_size"])
    if "vision_config" in config and config.get("hidden_size"):
        return int(config["hidden_size"])
    return None


def _as_field_type(field: dataclasses.Field, value: Any) -> Any:
    """JSON value -> the field's type where JSON cannot say it: lists -> tuples, ints -> floats, bools."""
    if typing.get_origin(field.type) is tuple or field.type is tuple:
        return tuple(value)
    if field.type is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if field.type is bool:
        return bool(value)
    return value


class TowerConfigBase:
    """Checkpoint reading, derived sizes and checks shared by the towers' typed configs (frozen
    dataclasses with num_heads, in_channels, temporal_patch_size, patch_size and a width field).

    hf_aliases: field -> the vision_config keys that may hold it, first present wins (a field without
    an entry is read under its own name; an empty tuple: never read from the checkpoint).
    """

    width_field: ClassVar[str] = "hidden_size"  # the tower's width (Qwen2-VL calls it embed_dim)
    hf_aliases: ClassVar[Mapping[str, tuple[str, ...]]] = {}

    @classmethod
    def from_hf(cls, config: Mapping[str, Any]):
        """The typed config of a config.json dict (or its vision_config alone): every field from the
        first of its keys present (not null) in the vision config, else its default; rope_theta from
        `rope_parameters` when there; then the values `hf_computed` derives."""
        vision = vision_config_dict(config)
        values = {}
        for field in dataclasses.fields(cls):
            key = next((k for k in cls.hf_aliases.get(field.name, (field.name,)) if vision.get(k) is not None), None)
            if key is not None:
                values[field.name] = _as_field_type(field, vision[key])
        rope = vision.get("rope_parameters") or {}
        if "rope_theta" in rope and "rope_theta" in {f.name for f in dataclasses.fields(cls)}:
            values["rope_theta"] = float(rope["rope_theta"])
        return cls(**{**values, **cls.hf_computed(vision, config)})

    @classmethod
    def hf_computed(cls, vision: dict[str, Any], config: Mapping[str, Any]) -> dict[str, Any]:
        """Fields a family computes from several keys (or from outside vision_config); none by default."""
        return {}

    def processor_defaults(self) -> dict[str, Any]:
        """preprocessor_config.json keys the tower implies, used where the checkpoint's file lacks them (or
        there is none: built-ins), e.g. SigLIP's patch size and image size; none by default."""
        return {}

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


class VisionTower(nn.Module):
    """The base of every tower (see the module docstring). A family calls `super().__init__(config,
    device, dtype)` first, builds its modules with `**self.factory_kwargs`, and implements
    `make_plan(grid, device)` and `forward`, which starts with `plan = self.plan_for(...)`.

    weight_map: the family's checkpoint -> parameter renames; plan_cache_size: plans kept (LRU).
    """

    weight_map: ClassVar[WeightMap] = WeightMap()
    plan_cache_size: ClassVar[int] = 8
    check_patch_features: ClassVar[bool] = False  # check_pixels also checks each row's C*p*p values

    def __init__(self, config: TowerConfigBase, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.factory_kwargs = {"device": device, "dtype": dtype}  # for building modules; not updated by .to()
        self.merge = config.spatial_merge_size
        self._plans = LRUCache(self.plan_cache_size)  # (grid, device) -> plan (device tensors)

    def read_grid(self, grid_thw: torch.Tensor) -> Grid:
        """grid_thw int64 [N, 3] (CPU) -> ((t, h, w), ...), checked (h, w multiples of the merge size)."""
        return read_grid(grid_thw, self.merge)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields: t * h * w / merge^2."""
        return [t * h * w // self.merge ** 2 for t, h, w in self.read_grid(grid_thw)]

    def plan(self, grid_thw: torch.Tensor, device):
        """The family's plan for this grid on `device`, built once by `make_plan` and cached."""
        grid = self.read_grid(grid_thw)
        return self._plans.get((grid, str(device)), lambda: self.make_plan(grid, device))

    def has_plan(self, grid_thw: torch.Tensor, device) -> bool:
        """Whether `plan(grid_thw, device)` is cached (with what forwards cached on it since)."""
        return (self.read_grid(grid_thw), str(device)) in self._plans

    def make_plan(self, grid: Grid, device):
        raise NotImplementedError(f"{type(self).__name__} must implement make_plan(grid, device)")

    def plan_for(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor):
        """The plan for a forward's inputs, after checking that they describe the same patches."""
        plan = self.plan(grid_thw, pixel_values.device)
        self.check_pixels(pixel_values, plan)
        return plan

    def check_pixels(self, pixel_values: torch.Tensor, plan) -> None:
        """ValueError unless pixel_values has plan.num_patches rows (of config.patch_features values each
        when check_patch_features)."""
        if self.check_patch_features:
            if pixel_values.shape[0] != plan.num_patches or pixel_values[0].numel() != self.config.patch_features:
                raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)} but grid_thw describes "
                                 f"{plan.num_patches} patches of {self.config.patch_features} values "
                                 f"([patches, C, p, p] or [patches, C*p*p]); pass the grid_thw that came with them")
            return
        if pixel_values.shape[0] != plan.num_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw describes {plan.num_patches} "
                             f"patches (sum of t*h*w); pass the grid_thw that came with these pixel_values")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in (names as the checkpoint's, tower prefix removed); returns the names
        of the parameters filled. Linears already prepared for a kernel backend get their plain weights
        back for the load and are prepared again after it."""
        plan = linear_plan(self)
        restore_linears(self)
        try:
            return load_named_weights(self, weights, self.weight_map)
        finally:
            prepare_plan(self, plan)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A tower family as the registry knows it.

    architectures: checkpoint `architectures` strings this family serves.
    tower_cls: the tower nn.Module class.
    config_from_hf: full config.json dict -> the tower's typed config.
    weight_prefixes: checkpoint name prefixes of the tower's tensors, tried in order
        (e.g. "model.visual.", "visual."); stripped before load_weights.
    processor_from_hf: preprocessor_config.json dict (or {} for defaults) -> image processor
        (`processor_for(kind)`: mmenc.preprocess.PROCESSORS[kind]).
    builtin_configs: name -> full config.json dict, for load_format="dummy" with no files.
    vision_model_types: the vision_config.model_type values this family serves under its architectures
        (empty: any); several families may share an architecture with different towers
        (LlavaForConditionalGeneration: Pixtral, CLIP or SigLIP), see `vision_model_type`.
    vision_architectures: transformers' vision-only model classes holding exactly this tower (e.g.
        "Qwen2_5_VisionTransformerPretrainedModel"): a checkpoint of one has the vision config itself as
        config.json and the tower's tensors without a prefix; it is read as a full checkpoint is.
    """

    architectures: tuple[str, ...]
    tower_cls: type
    config_from_hf: Callable[[Mapping[str, Any]], Any]
    weight_prefixes: tuple[str, ...]
    processor_from_hf: Callable[[Mapping[str, Any]], Any]
    builtin_configs: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    vision_model_types: tuple[str, ...] = ()
    vision_architectures: tuple[str, ...] = ()

    def serves(self, vision_type: str | None) -> bool:
        """Whether this family takes a checkpoint whose vision_config.model_type is `vision_type`."""
        return not self.vision_model_types or vision_type in self.vision_model_types


def vision_model_type(config: Mapping[str, Any]) -> str | None:
    """vision_config.model_type of a full config.json dict (None when absent; a vision config alone
    gives its own model_type)."""
    vision = vlm_config_dict(config).get("vision_config", config)
    return vision.get("model_type") if isinstance(vision, Mapping) else None


def _processor_of_kind(kind: str, preprocessor_config: Mapping[str, Any]):
    return importlib.import_module("mmenc.preprocess").get_processor(kind, preprocessor_config)


def processor_for(kind: str) -> Callable[[Mapping[str, Any]], Any]:
    """A `processor_from_hf` building the processor registered under `kind` in mmenc.preprocess.PROCESSORS
    (the one table of image processors, which tests and benchmarks read too), imported when first called
    (importing a tower does not import the image stack)."""
    return functools.partial(_processor_of_kind, kind)


def builtin_config(architecture: str, model_type: str, vision: Mapping[str, Any], **top: Any) -> dict[str, Any]:
    """A built-in model's config.json dict (bfloat16): its vision_config and top-level keys such as text_config."""
    return {"architectures": [architecture], "model_type": model_type, "torch_dtype": "bfloat16", **top,
            "vision_config": dict(vision)}
