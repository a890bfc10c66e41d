"""Building a tower from a checkpoint folder, a Hub id or a built-in name, and running it.

    loaded = build_tower("path/to/Qwen2.5-VL-7B-Instruct")            # weights from safetensors
    loaded = build_tower("Qwen/Qwen2.5-VL-7B-Instruct")                 # the Hub id, through huggingface_hub
    loaded = build_tower("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy")  # random weights, no files
    out = run_tower(loaded, pixel_values, grid_thw)                     # TowerOutput

The tower shards over the tensor-parallel group set in mmenc.distributed.parallel_state (unsharded
without one, as in data-parallel mode).
"""
import dataclasses
import functools
import pathlib
from typing import Any

import torch
import torch.nn as nn

from mmenc.config import MultiModalConfig, current_multimodal_config, use_multimodal_config
from mmenc.layers.norm import LayerNorm, RMSNorm
from mmenc.loader import checkpoint_folder, load_tower_weights, read_config, read_json_if_present
from mmenc.logger import init_logger
from mmenc.models.base import ModelSpec, TowerOutput, vlm_config_dict
from mmenc.models.registry import builtin_model_names, get_builtin_config, get_model_spec, supported_architectures

logger = init_logger(__name__)

LOAD_FORMATS = ("auto", "dummy")
DUMMY_SEED = 0
_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}
DTYPE_NAMES = tuple(_DTYPES)


@dataclasses.dataclass
class LoadedTower:
    """A tower ready to run: `tower` (eval mode, on `device`, in `dtype`) and what describes it.

    model: the folder or built-in name given; spec: its ModelSpec; hf_config: config.json as a dict;
    config: the tower's typed config; preprocessor_config: preprocessor_config.json ({} if none);
    load_format: "auto" (checkpoint weights) or "dummy" (random weights).
    """

    model: str
    spec: ModelSpec
    hf_config: dict[str, Any]
    config: Any
    tower: nn.Module
    dtype: torch.dtype
    device: torch.device
    load_format: str = "auto"
    preprocessor_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    graphs: Any = None  # a CudaGraphCache when MultiModalConfig.cuda_graphs is on
    video_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the video processor's settings
    linear_backend: Any = None  # the LinearBackendEnum its linears run on (None on the meta device)
    folder: pathlib.Path | None = None  # the checkpoint folder read (a Hub id's snapshot); None for a built-in

    @property
    def processor_settings(self) -> dict[str, Any]:
        """What the image processor is built from: preprocessor_config.json over the keys the tower implies
        (its config's processor_defaults(); all there is for a built-in name). A peer's processor built
        from it (mmenc bench --e2e) preprocesses as this one."""
        return {**getattr(self.config, "processor_defaults", dict)(), **self.preprocessor_config}

    @functools.cached_property
    def processor(self) -> Any:
        """The model's image processor (built on first use), from `processor_settings`."""
        return self.spec.processor_from_hf(self.processor_settings)

    @functools.cached_property
    def video_processor(self) -> Any:
        """The model's video processor (mmenc.preprocess.video_families), or None for a family that takes
        no video; from the checkpoint's video processor settings (transformers' file order) over the keys
        the tower implies."""
        from mmenc.preprocess.video_families import get_video_processor, video_kind

        kind = video_kind(self.hf_config.get("model_type"))
        if kind is None:
            return None
        defaults = getattr(self.config, "processor_defaults", dict)()
        return get_video_processor(kind, {**defaults, **self.video_config})

    @property
    def spatial_merge_size(self) -> int:
        return self.config.spatial_merge_size

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        """Embedding rows each image yields."""
        return self.tower.output_tokens(grid_thw)


def resolve_dtype(dtype: "str | torch.dtype", hf_config: dict[str, Any], device: torch.device) -> torch.dtype:
    """"auto": the checkpoint's torch_dtype (bfloat16 if unset) off CPU, float32 on CPU; a name or torch.dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str) or (dtype != "auto" and dtype.lower() not in _DTYPES):
        raise ValueError(f"dtype={dtype!r} is not valid; expected 'auto', a torch.dtype or one of "
                         f"{', '.join(_DTYPES)}")
    if dtype != "auto":
        return _DTYPES[dtype.lower()]
    if device.type == "cpu":
        return torch.float32
    name = hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16"
    return _DTYPES.get(str(name).removeprefix("torch."), torch.bfloat16)


def _hint_cpu_bfloat16(hf_config: dict[str, Any]) -> None:
    """dtype "auto" stays float32 on a CPU (docs/linear.md, "bfloat16 on CPUs"); where the CPU has bf16 dot
    products and the checkpoint is bfloat16, say once that --dtype bfloat16 is there to take."""
    from mmenc.backends import probe_device
    from mmenc.logger import log_once

    name = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "")
    info = probe_device("cpu")
    if info.bf16_dot and name.removeprefix("torch.") == "bfloat16":
        features = "/".join(sorted(info.features & {"avx512_bf16", "amx"}))
        log_once(logger, f"dtype auto: float32 on the CPU; this CPU has bfloat16 dot products ({features}) and "
                         f"the checkpoint is bfloat16: dtype='bfloat16' (--dtype bfloat16) runs its linears about "
                         f"2x faster, each image's embedding at cosine >= 0.999 to float32's (docs/linear.md)")


def default_device() -> torch.device:
    from mmenc.platforms import current_platform

    kind = current_platform.device_type
    if kind == "cuda" and not torch.cuda.is_available():
        kind = "cpu"
    return torch.device(kind)


def spec_for_config(hf_config: dict[str, Any], where: str) -> ModelSpec:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in supported_architectures():
            return get_model_spec(arch, hf_config)
    raise ValueError(f"{where}: architectures {archs} are not supported; supported: "
                     f"{', '.join(supported_architectures())}")


def resolve_checkpoint(model: str, load_format: str = "auto") -> str:
    """`model` as `build_tower` reads it: a local folder as given; a Hugging Face Hub id ("org/name")
    as its snapshot folder in the huggingface_hub cache, fetched if needed (the local cache first,
    HF_HUB_OFFLINE honoured; only config.json, the processor configs and the shards holding the
    tower's tensors: mmenc.loader.hub); with load_format="dummy" a built-in name as it is (no files).
    Raises ValueError (mmenc.loader.hub.HubModelError) naming the fix when it cannot."""
    from mmenc.loader.hub import hub_snapshot, looks_like_repo_id

    if pathlib.Path(model).expanduser().exists() or (load_format == "dummy" and model in builtin_model_names()):
        return model
    if looks_like_repo_id(model):
        return str(hub_snapshot(model, None if load_format == "dummy" else _tower_tensor_names,
                                text=_has_text_tower))
    raise ValueError(f"model {model!r} is neither an existing checkpoint folder nor a Hugging Face Hub id "
                     f"(org/name); pass a local folder with config.json and *.safetensors, a Hub id, or with "
                     f"load_format='dummy' (--load-format dummy, random weights) a built-in name such as "
                     f"{builtin_model_names()[0]!r} (all: mmenc.models.registry.builtin_model_names())")


def _resolve_model(model: str, load_format: str) -> tuple[ModelSpec, dict, pathlib.Path | None, str]:
    """(spec, config.json dict, folder or None, load format) for a folder, a Hub id or (with
    load_format="dummy") a built-in name, whose config is built in: no files (see resolve_checkpoint)."""
    source = resolve_checkpoint(model, load_format)
    if not pathlib.Path(source).expanduser().exists():  # a built-in name, dummy weights
        spec, hf_config = get_builtin_config(source)
        return spec, hf_config, None, "dummy"
    folder = checkpoint_folder(source)
    hf_config = read_config(folder)
    spec = spec_for_config(hf_config, f"{folder}/config.json")
    return spec, as_full_config(spec, hf_config), folder, load_format


def as_full_config(spec: ModelSpec, hf_config: dict[str, Any]) -> dict[str, Any]:
    """config.json of a vision-only checkpoint (one of spec.vision_architectures, e.g. a saved
    Qwen2_5_VisionTransformerPretrainedModel: the vision config itself) in the shape of a full one
    ({"architectures", "vision_config", dtype}); any other config.json as it is."""
    archs = hf_config.get("architectures") or []
    if "vision_config" in hf_config or not any(a in spec.vision_architectures for a in archs):
        return hf_config
    dtype = {k: hf_config[k] for k in ("torch_dtype", "dtype") if k in hf_config}
    return {"architectures": list(archs), **dtype, "vision_config": dict(hf_config)}


def tower_weight_prefixes(spec: ModelSpec, hf_config: dict[str, Any]) -> tuple:
    """The checkpoint prefixes of the tower's tensors: the family's, and for a vision-only checkpoint
    (config.json is the vision config, as transformers saves SiglipVisionModel or Glm4vVisionModel) also
    none at all, tried last."""
    vision_only = "vision_config" not in vlm_config_dict(hf_config) or any(
        a in spec.vision_architectures for a in hf_config.get("architectures") or [])
    return (*spec.weight_prefixes, "") if vision_only and "" not in spec.weight_prefixes else spec.weight_prefixes


def _has_text_tower(hf_config: dict[str, Any]) -> bool:
    from mmenc.models.text import TEXT_KINDS

    text = hf_config.get("text_config")
    return isinstance(text, dict) and text.get("model_type") in TEXT_KINDS


def _tower_tensor_names(hf_config: dict[str, Any], names: list[str]) -> set[str]:
    """The tensor names of a checkpoint's index that mmenc reads: the tower's (and a contrastive
    checkpoint's text tower's): which shards a Hub download fetches."""
    from mmenc.loader.checkpoint import prefix_group, tower_prefix

    spec = spec_for_config(hf_config, "config.json")
    groups = [prefix_group(tower_prefix(names, tower_weight_prefixes(spec, as_full_config(spec, hf_config))))]
    if _has_text_tower(hf_config):
        from mmenc.models.text import TEXT_PREFIXES

        groups.append(prefix_group(tower_prefix(names, TEXT_PREFIXES)))
    return {name for name in names if any(name.startswith(g) for g in groups)}


@torch.no_grad()
def init_dummy_weights(tower: nn.Module, seed: int = DUMMY_SEED) -> None:
    """Random weights, the same for a given seed and device: normal(0, 0.02) matrices, zero biases,
    norms at one (weight) and zero (bias)."""
    norm_params = {id(p): name.rsplit(".", 1)[-1] for m in tower.modules() if isinstance(m, (RMSNorm, LayerNorm))
                   for name, p in m.named_parameters()}
    generators: dict[torch.device, torch.Generator] = {}
    for p in tower.parameters():
        if p.device.type == "meta":
            continue
        if id(p) in norm_params:
            p.fill_(1.0 if norm_params[id(p)] == "weight" else 0.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            g = generators.setdefault(p.device, torch.Generator(p.device).manual_seed(seed))
            p.normal_(0.0, 0.02, generator=g)


def build_tower(model: str, load_format: str = "auto", dtype: "str | torch.dtype" = "auto",
                device: "str | torch.device | None" = None,
                multimodal_config: MultiModalConfig | None = None) -> LoadedTower:
    """Build the vision tower of `model`: a checkpoint folder, a Hugging Face Hub id (resolved through
    huggingface_hub, see resolve_checkpoint) or, with load_format="dummy", a built-in name such as
    "Qwen/Qwen2.5-VL-7B-Instruct" (no files).

    load_format: "auto" reads the tower's tensors from the checkpoint's safetensors; "dummy" gives
    random weights (seeded, with a warning) and reads no weights. dtype: "auto" is the checkpoint's torch_dtype on an
    accelerator and float32 on CPU. device: None is the current platform's device ("meta" builds
    without memory, for shapes). The tensor-parallel size is the parallel state's (module docstring).
    multimodal_config: how the tower runs (None: current_multimodal_config(), MultiModalConfig() outside
    a use_multimodal_config block); the tower is built inside
    use_multimodal_config(multimodal_config), where its attention layers read it, and the steps after
    loading (linear kernels, fused kernels, batch invariance, compile, CUDA graphs) take it from here.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r} is not valid; expected one of {LOAD_FORMATS}")
    spec, hf_config, folder, load_format = _resolve_model(str(model), load_format)
    device = torch.device(device) if device is not None else default_device()
    if dtype == "auto" and device.type == "cpu":
        _hint_cpu_bfloat16(hf_config)
    dtype = resolve_dtype(dtype, hf_config, device)
    config = spec.config_from_hf(hf_config)
    mm_config = multimodal_config if multimodal_config is not None else current_multimodal_config()
    with use_multimodal_config(mm_config):  # the layers read it while they are built (mmenc.config)
        tower = spec.tower_cls(config, device=device, dtype=dtype)
    if device.type != "meta":
        if load_format == "dummy":
            logger.warning("%s: load_format='dummy': the tower has RANDOM weights (seed %d); its embeddings "
                           "are meaningless", model, DUMMY_SEED)
            init_dummy_weights(tower)
        else:
            load_tower_weights(tower, folder, tower_weight_prefixes(spec, hf_config))
    linear_backend = None
    if device.type != "meta":  # after loading, before tiling or compiling: the platform's linear kernels
        from mmenc.engine.quantize import prepare_tower_linears
        from mmenc.platforms import platform_for

        linear_backend = prepare_tower_linears(tower, platform_for(device), dtype, mm_config, hf_config,
                                               spec.weight_prefixes)
    if mm_config.fused_kernels and device.type != "meta":
        from mmenc.layers.fused import use_fused_kernels
        from mmenc.platforms import platform_for

        reasons = platform_for(device).fused_kernel_reasons(dtype)
        if reasons:
            raise ValueError(f"fused_kernels=True cannot run on {device}: {'; '.join(reasons)}; leave fused_kernels "
                             f"off (the reference ops) on this device")
        use_fused_kernels(tower)
    # compiled RMSNorm / QuickGELU where the platform has them; a compiled tower gets Inductor's fusion anyway
    if device.type != "meta" and not mm_config.compile and not mm_config.batch_invariant:
        from mmenc.platforms import platform_for

        if platform_for(device).compiles_elementwise():
            from mmenc.layers.compiled_kernels import use_compiled_kernels

            use_compiled_kernels(tower)
    if mm_config.batch_invariant:  # before compiling / capturing: fixed-shape GEMMs in every linear
        from mmenc.distributed.parallel_state import get_tp_size
        from mmenc.layers.linear_kernels import use_token_tiles

        use_token_tiles(tower)
        if device.type == "cpu":  # torch's fused CPU activations give a tensor's last elements scalar code
            from mmenc.layers.activation import use_invariant_activations

            use_invariant_activations(tower)
        if get_tp_size() > 1:
            logger.warning("batch_invariant=True with the tower sharded over %d ranks (weights mode): the "
                           "all-reduce's summation order depends on the token count, so embeddings are not "
                           "guaranteed batch invariant; use mm_encoder_tp_mode='data'", get_tp_size())
    if mm_config.compile and device.type != "meta":
        from mmenc.engine.compile import compile_tower

        compile_tower(tower, mm_config)
    graphs = None
    if mm_config.cuda_graphs and device.type != "meta":
        from mmenc.engine.cuda_graphs import CudaGraphCache

        graphs = CudaGraphCache(tower, device)
    preprocessor = read_json_if_present(folder, "preprocessor_config.json") if folder is not None else {}
    return LoadedTower(model=str(model), spec=spec, hf_config=hf_config, config=config, tower=tower.eval(),
                       dtype=dtype, device=device, load_format=load_format, preprocessor_config=preprocessor,
                       graphs=graphs, video_config=_video_config(folder, preprocessor),
                       linear_backend=linear_backend, folder=folder)


def _video_config(folder, preprocessor: dict[str, Any]) -> dict[str, Any]:
    """The video processor's settings as transformers finds them (processor_config.json's
    "video_processor", else video_preprocessor_config.json, else preprocessor_config.json)."""
    if folder is None:
        return {}
    from mmenc.preprocess.video_families import video_config_from_files

    return video_config_from_files(read_json_if_present(folder, "processor_config.json"),
                                   read_json_if_present(folder, "video_preprocessor_config.json"), preprocessor)


def run_tower(loaded: LoadedTower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
    """pixel_values [patches, C*tp*p*p] (any float dtype, any device) and grid_thw int64 [N, 3]
    (on CPU; a device tensor costs one copy back) -> TowerOutput, embeddings [tokens, out_hidden] in
    the tower's dtype on its device, images in order."""
    with torch.inference_mode():
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64).cpu()
        pixel_values = pixel_values.to(device=loaded.device, dtype=loaded.dtype, non_blocking=True)
        return (loaded.graphs or loaded.tower)(pixel_values, grid_thw)


@dataclasses.dataclass(frozen=True)
class TowerRecipe:
    """How a rank builds and runs a tower (mmenc.parallel.rank.TowerRecipe): `build_tower`'s
    arguments except the device. Picklable: WorkerGroup workers receive it."""

    tower_args: dict[str, Any]

    def meta_tower(self) -> LoadedTower:
        """The tower on the meta device, unsharded (also where a TP group is set, as under torchrun):
        shapes without memory or weights read."""
        from mmenc.distributed.parallel_state import tp_group

        with tp_group(None):
            return build_tower(**{**self.tower_args, "device": "meta"})

    def tp_mode(self, mode: str, world: int) -> tuple[str, str | None]:
        """`resolve_tp_mode` for this tower: its heads and every size its parallel linears split."""
        from mmenc.layers.linear import tp_sharded_sizes
        from mmenc.parallel.modes import resolve_tp_mode

        if mode == "data" or world == 1:
            return mode, None
        loaded = self.meta_tower()
        return resolve_tp_mode(mode, getattr(loaded.config, "num_heads", None), world, tp_sharded_sizes(loaded.tower))

    def build(self, device: torch.device) -> LoadedTower:
        """Sharded over the current TP group (mmenc.distributed.parallel_state), whole without one."""
        return build_tower(**{**self.tower_args, "device": device})

    def run(self, built: LoadedTower, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        return run_tower(built, pixel_values, grid_thw)


def empty_output(meta: LoadedTower, device: torch.device) -> TowerOutput:
    """The tower's output for zero images: every tensor [0, ...] in its dtype on `device`, found by
    running the meta-device tower on one smallest image (shapes only, no compute)."""
    m = meta.config.spatial_merge_size
    grid = torch.tensor([[1, m, m]])
    with torch.inference_mode():
        out = meta.tower(torch.empty(m * m, meta.config.patch_features, device="meta", dtype=meta.dtype), grid)
    return out.map(lambda t: torch.empty(0, *t.shape[1:], dtype=t.dtype, device=device))
