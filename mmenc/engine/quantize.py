"""Which linears of a tower run quantized, and preparing them (MultiModalConfig.quantization).

    "fp8"      FP8 on the linears of the last quarter of the blocks (of every `blocks` list), the rest on
               the unquantized backend: where accuracy holds (docs/linear.md, "FP8": cosine >= 0.999 vs
               bf16 and error vs fp32 within 2x bf16's on Qwen2.5-VL-7B's tower at the published init scale)
    "fp8-all"  FP8 on every linear (patch embedding and merger too); below that bar, for speed studies
A checkpoint's own "do not quantize" list (config.json `quantization_config`: compressed-tensors'
`ignore`, or `modules_to_not_convert`) is honoured: a linear it names stays unquantized in either mode.
"""
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch.nn as nn

from mmenc.backends.linear import LinearBackendEnum
from mmenc.config import MultiModalConfig
from mmenc.layers.linear_kernels import linear_names, prepare_linears
from mmenc.loader.checkpoint import prefix_group
from mmenc.logger import init_logger

logger = init_logger(__name__)

_BLOCK = re.compile(r"(?:(.+)\.)?blocks\.(\d+)")


def checkpoint_ignore(hf_config: Mapping[str, Any]) -> list[str]:
    """The module names / "re:" patterns a checkpoint's quantization_config keeps unquantized."""
    qc = hf_config.get("quantization_config") or (hf_config.get("vision_config") or {}).get("quantization_config")
    if not isinstance(qc, Mapping):
        return []
    return list(qc.get("ignore") or []) + list(qc.get("modules_to_not_convert") or [])


def _ignored(names: Sequence[str], prefixes: Sequence[str], ignore: Sequence[str]) -> bool:
    """Whether an ignore entry names one of `names` (checkpoint names without the tower prefix, no
    `.weight`) under any of `prefixes`, or a module above it."""
    full = [p + n for n in names for p in (*prefixes, "")]
    for entry in ignore:
        if entry.startswith("re:"):
            if any(re.fullmatch(entry[3:], f) or re.fullmatch(entry[3:], f + ".weight") for f in full):
                return True
        elif any(f == entry or f.startswith(entry + ".") for f in full):
            return True
    return False


def quantized_linears(tower: nn.Module, mode: str, ignore: Sequence[str] = (),
                      weight_prefixes: Sequence = ()) -> set[str]:
    """Names of the linears of `tower` that `mode` ("fp8", "fp8-all") quantizes (see the module doc)."""
    if mode not in ("fp8", "fp8-all"):
        raise ValueError(f"quantization={mode!r} is not valid; expected 'fp8' or 'fp8-all'")
    linears = linear_names(tower)
    if mode == "fp8":
        depth: dict[str, int] = {}
        for name, _ in tower.named_modules():
            if (match := _BLOCK.fullmatch(name)) is not None:
                depth[match.group(1) or ""] = max(depth.get(match.group(1) or "", 0), int(match.group(2)) + 1)

        def in_last_quarter(name: str) -> bool:
            match = _BLOCK.match(name)
            if match is None or (match.group(1) or "") not in depth:
                return False
            n = depth[match.group(1) or ""]
            return int(match.group(2)) >= n - max(1, n // 4)
        linears = [name for name in linears if in_last_quarter(name)]
    prefixes = [p for entry in weight_prefixes for p in prefix_group(entry)]
    weight_map = getattr(tower, "weight_map", None)

    def sources(name: str) -> list[str]:
        if weight_map is None:
            return [name]
        return [n.removesuffix(".weight") for n in weight_map.checkpoint_names(name + ".weight")]
    return {name for name in linears if not (ignore and _ignored(sources(name), prefixes, ignore))}


def prepare_tower_linears(tower: nn.Module, platform, dtype, mm_config: MultiModalConfig,
                          hf_config: Mapping[str, Any], weight_prefixes: Sequence = ()) -> LinearBackendEnum:
    """Hand the tower's linears to the platform's backends: all to its choice for `dtype`, or, with
    quantization, the quantized ones (quantized_linears) to its quantized backend and the rest to its
    unquantized one. Returns the backend of the quantized linears (else the one backend)."""
    mode, invariant = mm_config.quantization, mm_config.batch_invariant
    backend = platform.get_linear_backend(dtype, mode, mm_config.linear_backend, invariant)
    if mode is None:
        prepare_linears(tower, backend)
        return backend
    targets = quantized_linears(tower, mode, checkpoint_ignore(hf_config), weight_prefixes)
    rest = platform.get_linear_backend(dtype, None, None, invariant)
    prepare_linears(tower, backend, include=targets.__contains__)
    prepare_linears(tower, rest, include=lambda name: name not in targets)
    total = len(linear_names(tower))
    logger.info("quantization=%s: %d of %d linears on %s, the rest on %s", mode, len(targets), total, backend.name,
                rest.name)
    return backend
