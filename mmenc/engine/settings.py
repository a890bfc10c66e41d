"""EncoderSettings: everything an Encoder is built with but the model, typed and validated once.

    settings = EncoderSettings(dtype="bfloat16", compile=True)       # ValueError naming a bad value
    enc = Encoder("path/to/checkpoint", settings)                    # or Encoder(path, dtype=..., ...)

Each field carries its command-line flag (`setting(...)`): the flags of `mmenc encode`, `bench` and
`serve` are made from these fields (mmenc.cli.flags), and so are docs/cli.md's tables (a test compares
them). The fields that change the tower's computation form its MultiModalConfig (`mm_config`), where
the spellings are normalised (the TP mode "weight" -> "weights", backend names -> enum members).
"""
import dataclasses
from typing import Any, Literal

import torch

from mmenc.backends import AttentionBackendEnum
from mmenc.backends.linear import QUANTIZATIONS, LinearBackendEnum
from mmenc.config import MultiModalConfig, parse_custom_ops
from mmenc.engine.checks import check_dtype, check_positive_int, check_timeout

COMMANDS = ("encode", "bench", "serve")  # the subcommands that build an Encoder from flags
MM_FIELDS = tuple(f.name for f in dataclasses.fields(MultiModalConfig))


def setting(default: Any, help: str, *, flag: str | None = None, metavar: str | None = None,
            choices: tuple | None = None, commands: tuple[str, ...] = COMMANDS,
            scope: dict[str, str] | None = None, shown_default: str | None = None, text: bool = False) -> Any:
    """A settings field with its command-line flag: `flag` (default: --field-name), its `help` (the
    default, or `shown_default`, is added to it), `metavar`, `choices`, the `commands` that get it (() for
    none: a Python-only setting), `scope`, a prefix of the help per command (e.g. {"bench": "with --e2e: "}),
    and `text`: the flag's value reaches the settings as written (they parse it, e.g. a size "64MiB")."""
    meta = dict(help=help, flag=flag, metavar=metavar, choices=choices, commands=commands, scope=scope or {},
                shown_default=shown_default, text=text)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class EncoderSettings:
    """How an Encoder is built and runs (docs/engine.md; the flags: docs/cli.md). After construction
    `mm_encoder_tp_mode` is "weights" or "data", backend fields the enum members' names or None."""

    load_format: Literal["auto", "dummy"] = setting(
        "auto", "auto: the checkpoint's weights; dummy: RANDOM weights, no weight files (a built-in name needs no "
        "files at all: mmenc.models.registry.builtin_model_names()); outputs say so", choices=("auto", "dummy"))
    dtype: str | torch.dtype = setting("auto", "auto (bf16 on GPU, float32 on CPU), bfloat16, float16, float32")
    device: str | None = setting(None, "torch device: cpu, cuda, cuda:N (default: the platform's)")
    mm_encoder_attn_backend: str | None = setting(
        None, "force one attention backend: " + ", ".join(b.name for b in AttentionBackendEnum), metavar="BACKEND")
    linear_backend: str | None = setting(
        None, "force one linear (matmul) backend: " + ", ".join(b.name for b in LinearBackendEnum)
        + " (default: the platform's; `mmenc backends` shows it)", metavar="BACKEND")
    quantization: str | None = setting(
        None, "quantize the tower's linears at load (fp8: FP8 weights and activations on the last quarter of the "
        "blocks, where accuracy holds; fp8-all: every linear, below the accuracy bar; CUDA sm89+; docs/linear.md)",
        choices=tuple(QUANTIZATIONS))
    fused_kernels: bool = setting(
        False, "CUDA: fused Triton row kernels (residual add + norm, SiLU-gate; with FP8 the quantization inside "
        "them); off: the reference ops (docs/kernels.md)")
    tensor_parallel_size: int = setting(1, "number of devices (worker processes) for the tower", metavar="N")
    mm_encoder_tp_mode: str = setting(
        "weights", "weights: shard the tower over the devices; data: one replica per device, images split",
        choices=("weights", "data"))
    custom_ops: tuple[str, ...] = setting(
        ("all",), "which CustomOps run their platform's forward: all or none, then +name / -name, comma-separated "
        "(e.g. all,-mm_encoder_attn); a disabled op runs its plain-PyTorch forward", metavar="SPEC")
    compile: bool = setting(False, "torch.compile the tower's blocks (first call compiles)")
    cuda_graphs: bool = setting(False, "CUDA only: replay one CUDA graph per packing seen before (the 2nd call of "
                                       "a packing captures)")
    batch_invariant: bool = setting(False, "each image's embedding bitwise the same whatever else is in the batch "
                                           "(fixed-shape GEMM tiles and attention sub-packs; costs some throughput)")
    worker_timeout_s: float = setting(
        600.0, "with --tensor-parallel-size > 1: the most one call waits for the worker processes before they "
        "count as hung", flag="--worker-timeout", metavar="SECONDS")
    max_batch_patches: int = setting(1 << 16, "the most patches one tower call takes", commands=())
    strict: bool = setting(False, "non-finite embeddings raise instead of a warning", commands=())
    preprocess_workers: int | None = setting(None, "decode/resize workers (None: one per usable core)", commands=())
    preprocess_worker_kind: str = setting(
        "auto", "where images are decoded and resized: 'thread' (a thread pool in this process), 'process' (files "
        "and bytes in worker processes, so the thread launching the tower does not share the GIL with the "
        "decoders; PIL images and arrays stay in threads), 'auto' (processes on a CUDA device with 8 or more "
        "workers, else threads)", choices=("auto", "thread", "process"), commands=("encode", "bench"),
        scope={"bench": "with --e2e or --video: "})
    preprocess_resize: str = setting(
        "auto", "where images are resized: 'cpu' (in the decode workers), 'device' (on the tower's device, the CPU "
        "kernel's bytes), 'split' (each call's first image per worker on the device, the rest in the workers), "
        "'auto' (split with worker processes on CUDA, device with threads; see docs/preprocessing.md)",
        choices=("auto", "cpu", "device", "split"), commands=("encode", "bench"), scope={"bench": "with --e2e or --video: "})
    high_bit_depth: Literal["clip", "scale"] = setting(
        "clip", "16-bit images (16-bit grayscale PNGs): 'clip' converts them as transformers does (values over 255 "
        "clip, so they come out almost white; a warning says so), for parity; 'scale' maps 0..65535 onto 0..255",
        choices=("clip", "scale"), commands=("encode",))
    cpu_malloc: Literal["tuned", "system"] = setting(
        "tuned", "with the tower on the CPU: 'tuned' lets glibc's malloc keep freed blocks (no fresh zeroed pages "
        "per call: 8-12% less CPU time; the process keeps its peak heap), 'system' leaves malloc as it is "
        "(mmenc/platforms/host_malloc.py)", choices=("tuned", "system"))
    first_chunk_patches: int | None = setting(
        None, "rows of the first tower call of each encode (None: max_batch_patches // 16)", metavar="N",
        commands=("bench",), scope={"bench": "with --e2e: "})
    chunk_growth: float = setting(
        2.0, "each later tower call of an encode takes up to X times the previous one's rows (inf: straight to "
        "max_batch_patches)", metavar="X", commands=("bench",), scope={"bench": "with --e2e: "})

    def __post_init__(self):
        for name in ("load_format", "preprocess_worker_kind", "preprocess_resize", "high_bit_depth", "cpu_malloc"):
            allowed = EncoderSettings.__dataclass_fields__[name].metadata["choices"]
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r} is not valid; expected one of {allowed}")
        check_dtype(self.dtype)
        check_positive_int("tensor_parallel_size", self.tensor_parallel_size, "the number of devices, e.g. 2")
        check_positive_int("max_batch_patches", self.max_batch_patches,
                           "the most patches one tower call takes, e.g. 65536")
        check_timeout("worker_timeout_s", self.worker_timeout_s)
        if self.first_chunk_patches is not None:
            check_positive_int("first_chunk_patches", self.first_chunk_patches,
                               "the most patches of the first tower call of a call, e.g. 4096")
        growth = self.chunk_growth
        if isinstance(growth, bool) or not isinstance(growth, (int, float)) or not growth >= 1:
            raise ValueError(f"chunk_growth={growth!r} must be a number >= 1 (2: each tower call of an encode "
                             f"up to twice the previous one; math.inf: the first call, then max_batch_patches)")
        if self.preprocess_workers is not None and (isinstance(self.preprocess_workers, bool) or not isinstance(
                self.preprocess_workers, int) or self.preprocess_workers < 0):
            raise ValueError(f"preprocess_workers={self.preprocess_workers!r} must be an int >= 0 (0: in the calling "
                             f"thread) or None (one per usable core)")
        object.__setattr__(self, "strict", bool(self.strict))
        object.__setattr__(self, "custom_ops", parse_custom_ops(self.custom_ops))
        mm = MultiModalConfig(**{name: getattr(self, name) for name in MM_FIELDS})  # validates and normalises
        object.__setattr__(self, "mm_encoder_tp_mode", mm.mm_encoder_tp_mode)
        object.__setattr__(self, "_mm_config", mm)

    @property
    def mm_config(self) -> MultiModalConfig:
        """The tower's MultiModalConfig (validated with these settings)."""
        return self._mm_config

    @property
    def first_call_patches(self) -> int:
        """The first tower call's patches: first_chunk_patches, or max_batch_patches // 16 (at most max_batch_patches)."""
        first = self.first_chunk_patches
        return min(self.max_batch_patches, first if first is not None else max(1, self.max_batch_patches // 16))

    @classmethod
    def merged(cls, settings: "EncoderSettings | None", options: dict[str, Any]) -> "EncoderSettings":
        """`settings` (None: the defaults) with `options` (field=value, which win over it): what
        `Encoder(model, settings, **options)` is built with. TypeError for a settings object of another type
        or an option that is not a field, ValueError (from __post_init__) for a bad value."""
        if settings is not None and not isinstance(settings, cls):
            raise TypeError(f"Encoder(model, settings): settings is {type(settings).__name__} {settings!r}; pass an "
                            f"EncoderSettings, or the options by keyword (dtype=..., device=...)")
        unknown = sorted(set(options) - set(cls.__dataclass_fields__))
        if unknown:
            raise TypeError(f"Encoder() got unknown options {unknown}; the options are EncoderSettings' fields: "
                            f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**options) if settings is None else dataclasses.replace(settings, **options)

    def as_kwargs(self) -> dict[str, Any]:
        """The settings as Encoder keyword arguments (plain values: they travel to Ray workers)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def flag_fields(command: str, settings_cls: type = EncoderSettings) -> list[dataclasses.Field]:
    """The fields of `settings_cls` (EncoderSettings, or another class whose fields are `setting`s, e.g.
    ServeSettings) that are flags of `command`, in declaration order."""
    return [f for f in dataclasses.fields(settings_cls) if command in f.metadata.get("commands", ())]


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata["flag"] or "--" + field.name.replace("_", "-")

