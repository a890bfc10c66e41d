"""Reading a local Hugging Face checkpoint folder: config.json and the tower's safetensors tensors only.

A folder holds config.json and either one `*.safetensors` file or several shards listed by
`model.safetensors.index.json`. Only the tensors under the tower's prefix are read, each through a
memory-mapped `safe_open`, so the text model's size does not matter.
"""
import contextlib
import json
import pathlib
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


def _listing(folder: pathlib.Path, limit: int = 12) -> str:
    names = sorted(p.name for p in folder.iterdir())
    if not names:
        return "the folder is empty"
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return "found: " + ", ".join(names[:limit]) + more


@contextlib.contextmanager
def open_safetensors(file: pathlib.Path):
    """`safe_open(file)` on the CPU; a truncated, garbage or unreadable file raises ValueError naming it."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"safetensors file {str(file)!r} is damaged or not a safetensors file ({e}); "
                         f"download or copy it again (a partial download leaves such a file)") from e
    except OSError as e:
        raise ValueError(f"safetensors file {str(file)!r} cannot be read ({e.strerror or e}); check that it "
                         f"exists and is readable") from e


def check_tensor_dtype(name: str, tensor: torch.Tensor, file: pathlib.Path) -> torch.Tensor:
    """`tensor`, or ValueError when a tower tensor is not floating point (an int32 weight would be
    cast silently into garbage; quantized checkpoints store packed integers)."""
    if not tensor.is_floating_point():
        raise ValueError(f"tensor {name!r} in {str(file)!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; "
                         f"vision-tower weights must be floating point (float32, bfloat16, float16); "
                         f"mmenc does not read quantized or integer-typed tower weights: use an unquantized "
                         f"checkpoint")
    return tensor


def check_not_fp8(name: str, tensor: torch.Tensor, file: pathlib.Path) -> torch.Tensor:
    """`tensor`, or ValueError for an FP8 tensor in a checkpoint without a quantization_config (its scales
    would be unknown, and a plain copy would load wrong values)."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"tensor {name!r} in {str(file)!r} is FP8 but config.json has no quantization_config; "
                         f"FP8 checkpoints (compressed-tensors, block-scaled FP8) name their layout there: restore "
                         f"the checkpoint's config.json")
    return tensor


def checkpoint_folder(path: str | pathlib.Path) -> pathlib.Path:
    """The folder as a Path; ValueError when it does not exist or is not a folder."""
    folder = pathlib.Path(path).expanduser()
    if not folder.exists():
        raise ValueError(f"checkpoint folder {str(folder)!r} does not exist; expected a local Hugging Face "
                         f"checkpoint folder (config.json + *.safetensors)")
    if not folder.is_dir():
        raise ValueError(f"checkpoint path {str(folder)!r} is a file; expected the folder holding config.json "
                         f"and *.safetensors")
    return folder


def read_config(path: str | pathlib.Path) -> dict[str, Any]:
    """config.json of a checkpoint folder as a dict."""
    folder = checkpoint_folder(path)
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(f"checkpoint folder {str(folder)!r} has no config.json ({_listing(folder)})")
    return _read_json(config)


def _read_json(file: pathlib.Path) -> Any:
    """A JSON file's content; ValueError naming the file when it is not valid JSON."""
    try:
        return json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); restore it from the original checkpoint") from e


def read_json_if_present(path: str | pathlib.Path, name: str) -> dict[str, Any]:
    """A JSON file of the folder (e.g. preprocessor_config.json) as a dict, or {} when absent."""
    file = pathlib.Path(path) / name
    return _read_json(file) if file.is_file() else {}


def tensor_files(path: str | pathlib.Path) -> dict[str, pathlib.Path]:
    """{tensor name: safetensors file holding it}, from the index when there is one (no file is
    opened; a shard need not be present unless its tensors are read: a Hub download fetches the
    tower's shards only), else from each file's header."""
    folder = checkpoint_folder(path)
    index = folder / INDEX_FILE
    if index.is_file():
        content = _read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no 'weight_map' mapping tensor names to shard files")
        return {name: folder / file for name, file in weight_map.items()}  # shards checked when read
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ValueError(f"checkpoint folder {str(folder)!r} has no *.safetensors files ({_listing(folder)}); "
                         f"mmenc reads safetensors checkpoints only")
    files = {}
    for shard in shards:
        with open_safetensors(shard) as f:
            files.update((name, shard) for name in f.keys())
    return files


def prefix_group(prefix: "str | tuple[str, ...]") -> tuple[str, ...]:
    """A `weight_prefixes` entry as the prefixes read together: a str is a group of one; a tuple
    (e.g. ("vision_tower.", "mm_projector.") for a tower whose projector sits beside it) is read
    whole, each name losing the first prefix of the group it starts with."""
    return (prefix,) if isinstance(prefix, str) else tuple(prefix)


def _strip(name: str, group: tuple[str, ...]) -> str:
    return next(name[len(p):] for p in group if name.startswith(p))


def tower_prefix(names: Sequence[str], prefixes: Sequence, where: str = "checkpoint"):
    """The first entry of `prefixes` (a prefix, or a tuple of prefixes read together: `prefix_group`)
    that some tensor name starts with; ValueError when none does."""
    for prefix in prefixes:
        if any(name.startswith(prefix_group(prefix)) for name in names):
            return prefix
    sample = ", ".join(sorted(names)[:5]) or "no tensors"
    raise ValueError(f"{where} has no vision-tower tensors: no name starts with any of {list(prefixes)} "
                     f"(names look like: {sample})")


def strip_tower_prefix(named: Iterable[tuple[str, torch.Tensor]], prefixes: Sequence,
                       where: str = "checkpoint") -> list[tuple[str, torch.Tensor]]:
    """In-memory tensors (e.g. a transformers model's state_dict items) as `iter_tower_tensors` gives a
    checkpoint's: those under the first of `prefixes` present, the prefix removed."""
    named = list(named)
    group = prefix_group(tower_prefix([name for name, _ in named], prefixes, where))
    return [(_strip(name, group), tensor) for name, tensor in named if name.startswith(group)]


def iter_tower_tensors(path: str | pathlib.Path, prefixes: Sequence[str],
                       files: dict[str, pathlib.Path] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without the tower prefix, CPU tensor) for every tensor under the tower's prefix (the first
    of `prefixes` present), shard by shard; nothing else is read. `files`: `tensor_files(path)` if known.
    ValueError naming the file for a damaged shard, and naming the tensor for a non-floating one."""
    files = tensor_files(path) if files is None else files
    group = prefix_group(tower_prefix(list(files), prefixes, f"checkpoint {str(path)!r}"))
    by_file: dict[pathlib.Path, list[str]] = {}
    for name, file in files.items():
        if name.startswith(group):
            by_file.setdefault(file, []).append(name)
    missing = sorted({file.name for file in by_file if not file.is_file()})
    if missing:
        folder = checkpoint_folder(path)
        raise ValueError(f"{folder / INDEX_FILE} lists shard file(s) {', '.join(missing)} that are not in "
                         f"{str(folder)!r} ({_listing(folder)})")
    config = pathlib.Path(path) / "config.json"
    quantization = (_read_json(config).get("quantization_config") if config.is_file() else None) or None
    tensors = _read(by_file, group, fp8=quantization is not None)
    if quantization is not None:  # FP8 weights are dequantized as they are read (mmenc.loader.fp8)
        from mmenc.loader.fp8 import dequantized_tensors

        tensors = dequantized_tensors(tensors, quantization)
    yield from tensors


def _read(by_file: dict[pathlib.Path, list[str]], group: tuple[str, ...],
          fp8: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name without the prefix, tensor), file by file; FP8 tensors only where `fp8` (a quantized checkpoint)."""
    for file, names in sorted(by_file.items()):
        with open_safetensors(file) as f:
            for name in sorted(names):
                tensor = check_tensor_dtype(name, f.get_tensor(name), file)
                yield _strip(name, group), tensor if fp8 else check_not_fp8(name, tensor, file)


def load_tower_weights(tower: torch.nn.Module, path: str | pathlib.Path, prefixes: Sequence[str]) -> set[str]:
    """Stream the tower's tensors into `tower.load_weights`; ValueError naming the checkpoint tensors
    that are missing afterwards. Returns the loaded parameter names."""
    files = tensor_files(path)
    prefix = tower_prefix(list(files), prefixes, f"checkpoint {str(path)!r}")
    try:
        loaded = tower.load_weights(iter_tower_tensors(path, (prefix,), files))
    except ValueError as e:
        raise ValueError(f"checkpoint {str(path)!r}, tower tensors under {prefix!r}: {e}") from e
    missing = [name for name, _ in tower.named_parameters() if name not in loaded]
    if missing:
        head = prefix if isinstance(prefix, str) else ""  # a group: names as the tower sees them
        names = [head + name for p in missing for name in _missing_names(tower, loaded, p)]
        shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
        raise ValueError(f"checkpoint {str(path)!r} lacks tensor(s) the {type(tower).__name__} needs: {shown}")
    return loaded


def _missing_names(tower: torch.nn.Module, loaded: set[str], param: str) -> list[str]:
    """Checkpoint names (without prefix) that would have filled `param`: only the absent shards when
    the tower's load_weights reports which arrived (LoadedWeights.shards_seen)."""
    weight_map = getattr(tower, "weight_map", None)
    if weight_map is None:
        return [param]
    seen = getattr(loaded, "shards_seen", {}).get(param, set())
    return [name for name, shard in weight_map.shards(param) if shard not in seen]
