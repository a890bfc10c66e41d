"""Flags and checks shared by the subcommands: encoder flags (derived from MultiModalConfig/Encoder),
log level, image pixel limit, device validation, output paths checked before work and written atomically."""
import argparse
import contextlib
import logging
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence

import torch

from mmenc.backends import AttentionBackendEnum
from mmenc.backends.linear import QUANTIZATIONS, LinearBackendEnum

LOG_LEVELS = ("debug", "info", "warning", "error")


def add_encoder_args(parser: argparse.ArgumentParser, default_model_help: str) -> None:
    parser.add_argument("--model", default=None,
                        help=f"checkpoint folder or Hugging Face Hub id, e.g. Qwen/Qwen2.5-VL-7B-Instruct (read from "
                             f"the huggingface_hub cache, else downloaded: config, processor configs and the tower's "
                             f"shards only; HF_HUB_OFFLINE=1 never downloads) ({default_model_help})")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="auto: the checkpoint's weights; dummy: RANDOM weights, no weight files (a built-in name "
                             "needs no files at all: mmenc.models.registry.builtin_model_names()); outputs say so")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, float32 on CPU), bfloat16, float16, float32")
    parser.add_argument("--device", default=None, help="torch device: cpu, cuda, cuda:N (default: the platform's)")
    parser.add_argument("--mm-encoder-attn-backend", default=None, metavar="BACKEND",
                        help="force one attention backend: " + ", ".join(b.name for b in AttentionBackendEnum))
    parser.add_argument("--linear-backend", default=None, metavar="BACKEND",
                        help="force one linear (matmul) backend: " + ", ".join(b.name for b in LinearBackendEnum)
                             + " (default: the platform's; `mmenc backends` shows it)")
    parser.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                        help="quantize the tower's linears at load (fp8: FP8 weights and activations on the last "
                             "quarter of the blocks, where accuracy holds; fp8-all: every linear, below the accuracy "
                             "bar; CUDA sm89+; docs/linear.md)")
    parser.add_argument("--fused-kernels", action="store_true",
                        help="CUDA: fused Triton row kernels (residual add + norm, SiLU-gate; with FP8 the "
                             "quantization inside them); off: the reference ops (docs/kernels.md)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="number of devices (worker processes) for the tower")
    parser.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default="weights",
                        help="weights: shard the tower over the devices; data: one replica per device, images split")
    parser.add_argument("--compile", action="store_true", help="torch.compile the tower's blocks (first call compiles)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="CUDA only: replay one CUDA graph per packing seen before (the 2nd call of a packing captures)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="each image's embedding bitwise the same whatever else is in the batch "
                             "(fixed-shape GEMM tiles and attention sub-packs; costs some throughput)")
    parser.add_argument("--worker-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="with --tensor-parallel-size > 1: the most one call waits for the worker processes "
                             "before they count as hung (default: %(default)s)")
    add_log_args(parser)


def add_log_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quiet", "-q", action="store_true",
                        help="print only warnings, errors and the result (no INFO logs, no progress lines)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default=None,
                        help="level of mmenc's log messages on stderr (default: info; warning with --quiet)")


def apply_log_level(args: argparse.Namespace) -> None:
    """Set the `mmenc` logger's level from --log-level / --quiet (INFO when neither is given)."""
    from mmenc.logger import init_logger

    init_logger("mmenc.cli")  # configures the package logger first, so the level set below stays
    name = args.log_level or ("warning" if args.quiet else "info")
    logging.getLogger("mmenc").setLevel(name.upper())


def encoder_kwargs(args: argparse.Namespace, default_model: str) -> dict:
    """Encoder(...) keyword arguments from the flags; --device is validated first (ValueError). Without
    --model: `default_model` (a built-in name) with random weights (load_format "dummy"), offline."""
    check_device(args.device)
    load_format = args.load_format if args.model else "dummy"  # no --model: the built-in default, random weights
    return dict(model=args.model or default_model, dtype=args.dtype, device=args.device,
                mm_encoder_attn_backend=args.mm_encoder_attn_backend, load_format=load_format,
                tensor_parallel_size=args.tensor_parallel_size, mm_encoder_tp_mode=args.mm_encoder_tp_mode,
                compile=args.compile, cuda_graphs=args.cuda_graphs, worker_timeout_s=args.worker_timeout,
                batch_invariant=args.batch_invariant, linear_backend=args.linear_backend,
                quantization=args.quantization, fused_kernels=args.fused_kernels)


def check_device(name: str | None) -> None:
    """ValueError (one line: the value, why, the fix) unless this torch can put tensors on `name`."""
    if name is None:
        return
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device {name!r} is not a torch device ({_first_line(e)}); "
                         f"use cpu, cuda or cuda:N") from e
    if device.type == "cpu":
        return
    if device.type == "meta":
        raise ValueError(f"--device {name!r}: the meta device holds no data; use cpu, cuda or cuda:N")
    if device.type == "cuda":
        if torch.version.cuda is None and torch.version.hip is None:
            raise ValueError(f"--device {name!r}: this torch {torch.__version__} is built without CUDA; install a "
                             f"CUDA build of torch (https://pytorch.org/get-started/locally/) or use --device cpu")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {name!r}: no CUDA device is visible (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}); check the driver "
                             f"(nvidia-smi) or use --device cpu")
        if device.index is not None and device.index >= count:
            raise ValueError(f"--device {name!r}: only {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
        return
    try:
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError, NotImplementedError) as e:
        raise ValueError(f"--device {name!r}: this torch {torch.__version__} cannot use {device.type} devices "
                         f"({_first_line(e)}); use --device cpu or a torch build with {device.type} support") from e


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


# -- images -------------------------------------------------------------------------------------

def add_image_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-image-pixels", type=int, default=None, metavar="N",
                        help="refuse images with more than N pixels as decompression bombs (default: PIL's "
                             f"limit, {_pil_default_limit()}); raise it for trusted large images; 0: no limit")
    parser.add_argument("--high-bit-depth", choices=["clip", "scale"], default="clip",
                        help="16-bit images (16-bit grayscale PNGs): 'clip' converts them as transformers does (values "
                             "over 255 clip, so they come out almost white; a warning says so), for parity; 'scale' "
                             "maps 0..65535 onto 0..255 (default: %(default)s)")


def add_preprocess_args(parser: argparse.ArgumentParser, scope: str = "") -> None:
    """--preprocess-worker-kind, --preprocess-resize: Preprocessor(worker_kind=..., resize=...),
    Encoder(preprocess_worker_kind=..., preprocess_resize=...)."""
    parser.add_argument("--preprocess-resize", choices=["auto", "cpu", "device", "split"], default="auto",
                        help=f"{scope}where images are resized: 'cpu' (in the decode workers), 'device' (on the "
                             "tower's device, the CPU kernel's bytes), 'split' (each call's first image per worker on the "
                             "device, the rest in the workers), 'auto' (split with worker processes on CUDA, device "
                             "with threads; see docs/preprocessing.md; default: %(default)s)")
    parser.add_argument("--preprocess-worker-kind", choices=["auto", "thread", "process"], default="auto",
                        help=f"{scope}where images are decoded and resized: 'thread' (a thread pool in this process), "
                             "'process' (files and bytes in worker processes, so the thread launching the tower "
                             "does not share the GIL with the decoders; PIL images and arrays stay in threads), "
                             "'auto' (processes on a CUDA device with 8 or more workers, else threads; "
                             "default: %(default)s)")


def _pil_default_limit() -> int | None:
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS


@contextlib.contextmanager
def image_pixel_limit(max_image_pixels: int | None) -> Iterator[int | None]:
    """Within the block, PIL's own bomb check follows --max-image-pixels (None: unchanged, 0: off);
    yields the `max_pixels` to pass to `load_images`. PIL's setting is restored afterwards."""
    from PIL import Image

    if max_image_pixels is None:
        yield -1
        return
    if max_image_pixels < 0:
        raise ValueError(f"--max-image-pixels={max_image_pixels} must be >= 0 (0: no limit)")
    before = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_image_pixels or None
    try:
        yield max_image_pixels or None
    finally:
        Image.MAX_IMAGE_PIXELS = before


# -- output files -------------------------------------------------------------------------------

def check_output_path(path: str, flag: str, inputs: Sequence[str] = ()) -> pathlib.Path:
    """`path` as a Path, checked before any work: not a folder, its folder exists and is writable,
    and it is none of `inputs` (never overwrite an input). ValueError naming the flag and the fix."""
    out = pathlib.Path(path).expanduser()
    if out.is_dir():
        raise ValueError(f"{flag} {path!r} is a folder; give a file path inside it, e.g. {str(out / 'out')!r}")
    parent = out.parent if str(out.parent) else pathlib.Path(".")
    if not parent.is_dir():
        raise ValueError(f"{flag} {path!r}: folder {str(parent)!r} does not exist; create it first "
                         f"(mkdir -p {parent})")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: folder {str(parent)!r} is not writable; choose another location")
    if out.exists():
        for item in inputs:
            if os.path.exists(item) and os.path.samefile(out, item):
                raise ValueError(f"{flag} {path!r} is one of the inputs ({item!r}); it would be overwritten: "
                                 f"choose another output file")
    return out


def write_atomically(path: pathlib.Path, write: Callable[[str], None]) -> None:
    """`write(tmp)` to a temporary file beside `path`, then rename it onto `path` with the umask's
    permissions (mmenc.files.write_atomically): a reader never sees a half-written file, and an
    interruption leaves any earlier `path` as it was."""
    from mmenc.files import write_atomically as write_whole

    write_whole(path, write)
