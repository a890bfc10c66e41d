"""FP8 accuracy against the bar of issue 27: per-image cosine >= 0.999 against the bf16 output, and the
relative error against float32 at most 2x bf16's, on weights at the published init scale
(mmenc.testing.random_weights: normal(0, 0.02) matrices, norms 1 + normal(0, 0.1)).

    report = fp8_accuracy("Qwen/Qwen2.5-VL-7B-Instruct", grids=[(1, 16, 16)] * 2, device="cuda")
    report["fp8"] -> {"cosine_min": ..., "err_vs_fp32": ..., "err_ratio": ..., "meets_bar": ...}

Each tower is built from a built-in config (optionally with fewer blocks, `depth`), its weights drawn
on the CPU from one seed, so the float32, bfloat16 and FP8 towers hold the same values. The FP8 towers
run the FP8 linear backend itself (torch._scaled_mm; on the CPU torch's reference kernel).
"""
from collections.abc import Sequence

import torch

from mmenc.backends.linear.fp8 import Fp8Linear
from mmenc.engine.quantize import quantized_linears
from mmenc.layers.fused import use_fused_kernels
from mmenc.layers.linear_kernels import prepare_linears
from mmenc.models.registry import get_builtin_config
from mmenc.testing.random_weights import init_comparable_weights_

COSINE_BAR = 0.999
ERROR_RATIO_BAR = 2.0


def build_random_tower(model: str, dtype: torch.dtype, device, depth: int | None = None, seed: int = 0):
    """The tower of built-in `model` with comparable random weights (`depth` blocks if given)."""
    spec, hf_config = get_builtin_config(model)
    hf_config = {**hf_config, "vision_config": dict(hf_config["vision_config"])}
    vision = hf_config["vision_config"]
    if depth is not None:
        full = vision.get("depth", vision.get("num_hidden_layers"))
        vision["depth" if "depth" in vision else "num_hidden_layers"] = depth
        if "fullatt_block_indexes" in vision:  # keep the full-attention layers' spacing
            step = max(1, full // len(vision["fullatt_block_indexes"]))
            vision["fullatt_block_indexes"] = [i for i in range(step - 1, depth, step)] or [depth - 1]
    tower = spec.tower_cls(spec.config_from_hf(hf_config), device=device, dtype=dtype)
    init_comparable_weights_(tower, seed=seed)
    return tower.eval()


def _per_image(out: torch.Tensor, tokens: Sequence[int]) -> list[torch.Tensor]:
    return list(out.float().split(list(tokens)))


def fp8_accuracy(model: str, grids: Sequence[tuple[int, int, int]], device="cpu", depth: int | None = None,
                 modes: Sequence[str] = ("fp8", "fp8-all"), seed: int = 0) -> dict:
    """{"bf16": {"err_vs_fp32"}, mode: {"cosine_min", "err_vs_fp32", "err_ratio", "meets_bar", "linears"}}
    over random pixels of `grids`. A mode ending in "+fused" ("fp8+fused") runs with the fused kernels
    (mmenc.layers.fused: the quantization inside the norm / SiLU-gate kernels); "bf16+fused": the fused
    kernels without FP8 (how far the fused bf16 path itself is from the reference bf16 one)."""
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    g = torch.Generator().manual_seed(seed + 1)
    outputs: dict[str, torch.Tensor] = {}
    tokens = None
    if any(m.removesuffix("+fused") not in ("bf16", "fp8", "fp8-all") for m in modes):
        raise ValueError(f"modes={list(modes)!r}; expected fp8, fp8-all or bf16, each optionally with +fused")
    for name in ("fp32", "bf16", *modes):
        dtype = torch.float32 if name == "fp32" else torch.bfloat16
        tower = build_random_tower(model, dtype, device, depth, seed)
        quantization = name.removesuffix("+fused")
        if tokens is None:
            tokens = tower.output_tokens(grid_thw)
            features = tower.config.patch_features
            pixels = torch.randn(int(grid_thw.prod(-1).sum()), features, generator=g)
        count = None
        if name in modes:
            targets = quantized_linears(tower, quantization, weight_prefixes=()) if quantization != "bf16" else set()
            count = prepare_linears(tower, Fp8Linear, include=targets.__contains__)
            if name.endswith("+fused"):
                import mmenc.backends.kernels.fused_rows  # noqa: F401  registers the mmenc::fused_* ops

                use_fused_kernels(tower)
        with torch.inference_mode():
            out = tower(pixels.to(device, dtype), grid_thw)
        outputs[name] = (out.embeddings if hasattr(out, "embeddings") else out).float().cpu()
        if count is not None:
            outputs[name + ":linears"] = count
        del tower
    fp32 = outputs["fp32"]

    def err(x):
        return ((x - fp32).norm() / fp32.norm()).item()

    report = {"bf16": {"err_vs_fp32": err(outputs["bf16"])}}
    for mode in modes:
        cos = [torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0).item()
               for a, b in zip(_per_image(outputs[mode], tokens), _per_image(outputs["bf16"], tokens))]
        ratio = err(outputs[mode]) / max(report["bf16"]["err_vs_fp32"], 1e-30)
        report[mode] = {"cosine_min": min(cos), "err_vs_fp32": err(outputs[mode]), "err_ratio": ratio,
                        "meets_bar": min(cos) >= COSINE_BAR and ratio <= ERROR_RATIO_BAR,
                        "linears": outputs[mode + ":linears"]}
    return report
