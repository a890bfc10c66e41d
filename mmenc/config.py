"""Typed, validated configuration. Imports only the ground floor (mmenc.backends).

The MultiModalConfig a tower is built under is a build context, not a constructor argument: the
engine builds inside `use_multimodal_config(config)` and the layers that depend on it (the encoder
attention) read `current_multimodal_config()` when they are constructed, the way the parallel
linears read the tensor-parallel state. Towers and blocks never take or hold it.
"""
import contextlib
import contextvars
import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Literal

from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.linear import QUANTIZATIONS, LinearBackendEnum

TPMode = Literal["weights", "data"]
_TP_MODE_ALIASES = {"weights": "weights", "weight": "weights", "data": "data"}


def parse_custom_ops(spec: Sequence[str]) -> tuple[str, ...]:
    """Validate a custom_ops setting; returns it as a tuple. Raises ValueError naming a bad entry."""
    if isinstance(spec, str):
        spec = tuple(s for s in spec.split(",") if s.strip())
    for item in spec:
        if not isinstance(item, str):
            raise ValueError(f"custom_ops entry {item!r} is not a string; expected 'all', 'none', '+name' or '-name'")
    spec = tuple(s.strip() for s in spec)
    for item in spec:
        if item not in ("all", "none") and not (len(item) > 1 and item[0] in "+-"):
            raise ValueError(f"custom_ops entry {item!r} is not valid; expected 'all', 'none', '+name' or '-name'")
    return spec


@dataclasses.dataclass(frozen=True)
class MultiModalConfig:
    """How the vision encoder runs.

    mm_encoder_attn_backend: a backend name (any case) or AttentionBackendEnum member; None lets
        the platform choose. Stored as the enum member after validation.
    mm_encoder_tp_mode: "weights" shards the tower across tensor-parallel ranks ("weight" is an
        alias); "data" keeps a full replica per rank and splits the images.
    custom_ops: which CustomOps use their platform forward: ("all",) or ("none",) followed by
        "+name" / "-name" entries (e.g. ("all", "-mm_encoder_attn")); a disabled op runs
        forward_native. A comma-separated string is accepted.
    compile: run the tower's blocks through torch.compile (regional; see mmenc.engine.compile).
    cuda_graphs: capture each packing's whole tower forward as a CUDA graph and replay it when the
        same packing comes again (CUDA only; see mmenc.engine.cuda_graphs).
    batch_invariant: an image's embedding is bitwise the same whatever else shares its call (any
        order, any chunking): linears over fixed-size token tiles, attention over fixed-shape
        sub-packs by backends that can (docs/attention.md, "Batch invariance"). Costs throughput.
    linear_backend: a linear backend name (any case) or LinearBackendEnum member; None lets the platform
        choose (the CPU: ONEDNN, packed weights; docs/linear.md). Stored as the enum member.
    quantization: None (the checkpoint's weights as loaded), "fp8" (FP8 linears on the last quarter of the
        blocks, where accuracy holds) or "fp8-all" (every linear; below the accuracy bar: docs/linear.md).
    fused_kernels: the fused row kernels (residual add + norm, gated activation, FP8 quantization inside
        them) where the platform has them (docs/kernels.md); False: the reference ops.
    """

    mm_encoder_attn_backend: AttentionBackendEnum | str | None = None
    mm_encoder_tp_mode: TPMode = "weights"
    custom_ops: tuple[str, ...] = ("all",)
    compile: bool = False
    cuda_graphs: bool = False
    batch_invariant: bool = False
    linear_backend: LinearBackendEnum | str | None = None
    quantization: str | None = None
    fused_kernels: bool = False

    def __post_init__(self):
        if self.linear_backend is not None:
            object.__setattr__(self, "linear_backend", LinearBackendEnum.from_name(self.linear_backend))
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization={self.quantization!r} is not valid; expected None or one of "
                             f"{', '.join(QUANTIZATIONS)}")
        if self.mm_encoder_attn_backend is not None:
            backend = AttentionBackendEnum.from_name(self.mm_encoder_attn_backend)
            object.__setattr__(self, "mm_encoder_attn_backend", backend)
        mode = self.mm_encoder_tp_mode
        if not isinstance(mode, str) or mode.lower() not in _TP_MODE_ALIASES:
            raise ValueError(f"mm_encoder_tp_mode={mode!r} is not valid; expected 'weights' or 'data' "
                             f"('weight' is accepted for 'weights')")
        object.__setattr__(self, "mm_encoder_tp_mode", _TP_MODE_ALIASES[mode.lower()])
        object.__setattr__(self, "custom_ops", parse_custom_ops(self.custom_ops))
        for flag in ("compile", "cuda_graphs", "batch_invariant", "fused_kernels"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"{flag}={getattr(self, flag)!r} must be True or False")

    def compute_hash(self) -> str:
        """A digest of every field that changes the computation (compile caches key on it)."""
        backend = self.mm_encoder_attn_backend
        fields = [backend.name if backend is not None else "auto", self.mm_encoder_tp_mode, ",".join(self.custom_ops),
                  f"compile={self.compile}", f"cuda_graphs={self.cuda_graphs}",
                  f"batch_invariant={self.batch_invariant}",
                  f"linear={self.linear_backend.name if self.linear_backend is not None else 'auto'}",
                  f"quantization={self.quantization}", f"fused_kernels={self.fused_kernels}"]
        return hashlib.sha256("|".join(fields).encode()).hexdigest()[:16]


_CURRENT: contextvars.ContextVar["MultiModalConfig | None"] = contextvars.ContextVar("mmenc_multimodal_config",
                                                                                      default=None)
_DEFAULT = MultiModalConfig()


@contextlib.contextmanager
def use_multimodal_config(config: MultiModalConfig) -> Iterator[MultiModalConfig]:
    """Build under `config`: inside the block, current_multimodal_config() returns it. Nestable (the
    inner config holds until its block ends); the previous one comes back on exit, exceptions included.
    A context variable, so each thread and asyncio task sees its own."""
    if not isinstance(config, MultiModalConfig):
        raise TypeError(f"use_multimodal_config expects a MultiModalConfig, got {type(config).__name__}: {config!r}")
    token = _CURRENT.set(config)
    try:
        yield config
    finally:
        _CURRENT.reset(token)


def current_multimodal_config() -> MultiModalConfig:
    """The config of the innermost use_multimodal_config block; MultiModalConfig() outside any."""
    config = _CURRENT.get()
    return config if config is not None else _DEFAULT
