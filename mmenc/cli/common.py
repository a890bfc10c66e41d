"""Flags and checks shared by the subcommands: encoder flags (made from EncoderSettings: mmenc.cli.flags),
log level, image pixel limit, device validation, output paths checked before work and written atomically."""
import argparse
import contextlib
import logging
import os
import pathlib
from collections.abc import Callable, Iterator, Sequence

import torch


LOG_LEVELS = ("debug", "info", "warning", "error")


def add_encoder_args(parser: argparse.ArgumentParser, default_model_help: str, command: str | None = None) -> None:
    """--model, the flags made from EncoderSettings for `command` (default: the parser's subcommand name;
    "serve", the flags every command has, for a parser of its own), and the log flags."""
    from mmenc.cli.flags import add_settings_flags
    from mmenc.engine.settings import COMMANDS

    parser.add_argument("--model", default=None,
                        help=f"checkpoint folder or Hugging Face Hub id, e.g. Qwen/Qwen2.5-VL-7B-Instruct (read from "
                             f"the huggingface_hub cache, else downloaded: config, processor configs and the tower's "
                             f"shards only; HF_HUB_OFFLINE=1 never downloads) ({default_model_help})")
    name = parser.prog.split()[-1]
    add_settings_flags(parser, command or (name if name in COMMANDS else "serve"))
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
    """Encoder(...) keyword arguments from the flags (EncoderSettings, validated; --device is checked first).
    Without --model: `default_model` (a built-in name) with random weights (load_format "dummy"), offline."""
    from mmenc.cli.flags import settings_from_args

    check_device(args.device)
    kwargs = settings_from_args(args).as_kwargs()
    if not args.model:
        kwargs["load_format"] = "dummy"  # no --model: the built-in default, random weights
    return dict(model=args.model or default_model, **kwargs)


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


def write_json_atomically(path: pathlib.Path, payload: dict) -> None:
    """`payload` as indented JSON at `path`, written as write_atomically writes (the --json of `mmenc bench`)."""
    import json

    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(payload, f, indent=1)

    write_atomically(path, dump)
