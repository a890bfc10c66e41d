"""Checkpoints that ship FP8 weights: dequantized as they are read, so every tower loads them.

Two layouts, as published (e.g. compressed-tensors "FP8-dynamic" models, and the block-scaled FP8 of
Qwen3-VL-*-FP8 / DeepSeek-style checkpoints):
  compressed-tensors   `X.weight` float8_e4m3fn [out, in] + `X.weight_scale` [out, 1] (per channel) or [] / [1]
                       (per tensor); a static `X.input_scale` may be present (mmenc scales activations per
                       token itself and ignores it)
  block-scaled FP8     `X.weight` float8_e4m3fn [out, in] + `X.weight_scale_inv` [ceil(out/bo), ceil(in/bi)],
                       quantization_config.weight_block_size = [bo, bi] (default 128 x 128)
value = weight * scale (per its block). Modules the checkpoint keeps unquantized (its `ignore` /
`modules_to_not_convert` list) arrive in their own dtype and pass through; with
MultiModalConfig(quantization="fp8") they also stay unquantized (mmenc.engine.quantize).
With quantization="fp8" the dequantized weights are quantized again per output channel: exact for a
per-channel checkpoint quantized with amax / 448 scales, one more rounding for block-scaled ones.
"""
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

SCALE_SUFFIXES = (".weight_scale", ".weight_scale_inv")
DROPPED_SUFFIXES = (".input_scale", ".output_scale", ".k_scale", ".v_scale")


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def block_size(quantization_config: Mapping[str, Any] | None) -> tuple[int, int]:
    size = (quantization_config or {}).get("weight_block_size") or (128, 128)
    if len(size) != 2 or min(size) < 1:
        raise ValueError(f"quantization_config.weight_block_size={size!r}; expected two positive sizes [out, in]")
    return int(size[0]), int(size[1])


def dequantize(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """weight (FP8) * scale as float32: per tensor, per output channel, or per [block] tile."""
    w, s = weight.float(), scale.float()
    out, inp = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.numel() == out and (s.dim() == 1 or s.shape[-1] == 1):
        return w * s.reshape(out, 1)
    tiles = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    if tuple(s.shape) != tiles:
        raise ValueError(f"FP8 tensor {name!r} [{out}, {inp}] has a scale of shape {tuple(s.shape)}; expected one "
                         f"value, [{out}, 1] (per channel) or {list(tiles)} (blocks of {block[0]} x {block[1]}, "
                         f"quantization_config.weight_block_size)")
    full = s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:out, :inp]
    return w * full


def dequantized_tensors(tensors: Iterable[tuple[str, torch.Tensor]],
                        quantization_config: Mapping[str, Any] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with every FP8 weight replaced by its float32 value and its scales dropped;
    other tensors pass through. ValueError naming a weight whose scale never comes."""
    block = block_size(quantization_config)
    weights: dict[str, torch.Tensor] = {}  # FP8 weights waiting for their scale, by module name
    scales: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name.endswith(DROPPED_SUFFIXES):
            continue
        suffix = next((s for s in SCALE_SUFFIXES if name.endswith(s)), None)
        if suffix is not None:
            module = name[: -len(suffix)]
            if module in weights:
                yield module + ".weight", dequantize(module + ".weight", weights.pop(module), tensor, block)
            else:
                scales[module] = tensor
        elif name.endswith(".weight") and is_fp8(tensor):
            module = name[: -len(".weight")]
            if module in scales:
                yield name, dequantize(name, tensor, scales.pop(module), block)
            else:
                weights[module] = tensor
        else:
            yield name, tensor
    if weights:
        missing = ", ".join(sorted(weights)[:5])
        raise ValueError(f"FP8 weight(s) {missing} have no .weight_scale / .weight_scale_inv tensor in the "
                         f"checkpoint; an FP8 checkpoint stores one scale tensor beside each FP8 weight")
