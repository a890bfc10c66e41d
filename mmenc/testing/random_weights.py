"""Random weights whose outputs can be compared between two implementations.

A deep tower with random weights of a large spread (e.g. randn * 0.2 at width 1152) is chaotic: each
layer multiplies small rounding differences, so two correct implementations in bf16 disagree by a
relative error near 1 and the error column of a benchmark says nothing. With the spread of a trained
model's initialisation (normal(0, 0.02) matrices) the same towers agree to rounding.

    init_comparable_weights_(hf_model, include=lambda name: "vision_tower" in name)
    hf_model.save_pretrained(folder)        # mmenc loads the same, comparable weights from the folder
"""
from collections.abc import Callable

import torch

NORM_MARKERS = ("norm", "ln_")


@torch.no_grad()
def init_comparable_weights_(module: torch.nn.Module, std: float = 0.02, norm_std: float = 0.1, seed: int = 0,
                             include: Callable[[str], bool] | None = None) -> int:
    """Overwrite `module`'s parameters in place (those whose name `include` accepts; all by default):
    matrices and other tensors of 2+ dims ~ normal(0, std); 1-D norm weights (the `weight` of a module
    whose class name holds "Norm", or a name holding "norm" or "ln_") ~ 1 + normal(0, norm_std); other
    1-D tensors (biases) ~ normal(0, std).
    The values depend only on `seed` and the parameter names/shapes (drawn on the CPU in float32,
    then cast), not on the device or dtype. Returns the number of parameters set."""
    if std <= 0 or norm_std < 0:
        raise ValueError(f"std={std} must be > 0 and norm_std={norm_std} >= 0")
    generator = torch.Generator(device="cpu").manual_seed(seed)
    norm_weights = {id(m.weight) for m in module.modules()
                    if "norm" in type(m).__name__.lower() and isinstance(getattr(m, "weight", None), torch.Tensor)}
    count = 0
    for name, param in module.named_parameters():
        if include is not None and not include(name):
            continue
        values = torch.randn(param.shape, generator=generator, dtype=torch.float32)
        leaf = name.rsplit(".", 1)[-1]
        is_norm = param.dim() == 1 and (id(param) in norm_weights or (
            leaf == "weight" and any(m in name.lower() for m in NORM_MARKERS)))
        values = 1.0 + norm_std * values if is_norm else std * values
        param.copy_(values.to(device=param.device, dtype=param.dtype))
        count += 1
    return count
