"""RMSNorm through an Inductor-compiled kernel, for CPUs: torch's eager rms_norm on the CPU is a chain of
unfused ops (square, mean, rsqrt, two multiplies, a cast), about 6x the time of its layer_norm.

One [5476, 1280] row block (Qwen2.5-VL-7B at 1 x 1036 px), one thread, on this project's Xeon with AMX:
bf16 17.2 ms eager, 2.1 ms compiled; float32 15.9 ms against 3.6 ms; the same values to 1e-7 (float32) and
the same float32 statistics. The tower's two norms per block are 64 such calls.

    use_compiled_norms(module) -> int    every RMSNorm of `module` runs `rms_norm` (how many it set)
    rms_norm(x, weight, eps) -> [..., D] F.rms_norm's result; compiled once per process (dynamic shapes)
    warm(module) -> list[str]            compile now for the dtypes and widths of `module`'s norms

Row blocks smaller than MIN_ELEMENTS run F.rms_norm (nothing to win there, and the tiny towers of the test
suite never compile). The first large call compiles (a few seconds; Inductor keeps it in its on-disk
cache); a server calls `warm` at load so that its first request does not pay it. Where compiling fails (no C++ compiler, an Inductor error) the failure is logged once and F.rms_norm
runs from then on. The platform decides where this runs (Platform.compiles_norms); the engine leaves it off
when the whole tower is compiled (Inductor fuses the norm there itself) and in batch-invariant mode.
"""
import threading

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.logger import init_logger
from mmenc.layers.norm import RMSNorm

logger = init_logger(__name__)

MIN_ELEMENTS = 1 << 18  # x.numel() from which the compiled kernel runs
WARM_ROWS = 1024  # warm() compiles for norms that reach MIN_ELEMENTS within one 448 px Qwen image's patches
_lock = threading.Lock()
_state: dict[str, object] = {"fn": None, "failed": False}


def _reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _compiled():
    """The compiled function (made once, under the lock), or None after a failure."""
    fn = _state["fn"]
    if fn is not None:
        return fn
    with _lock:
        if _state["fn"] is None and not _state["failed"]:
            _state["fn"] = torch.compile(_reference, dynamic=True)
        return _state["fn"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """F.rms_norm(x, (D,), weight, eps) for x [..., D], compiled for large inputs (see the module's text)."""
    if x.numel() < MIN_ELEMENTS or _state["failed"] or torch.compiler.is_compiling():
        return _reference(x, weight, eps)
    fn = _compiled()
    if fn is None:
        return _reference(x, weight, eps)
    try:
        return fn(x, weight, eps)
    except Exception as e:  # noqa: BLE001 - any compile failure: the reference, said once
        with _lock:
            _state["failed"], _state["fn"] = True, None
        logger.warning("compiled RMSNorm unavailable (%s: %s); running torch's rms_norm", type(e).__name__,
                       str(e).splitlines()[0][:200] if str(e) else "")
        return _reference(x, weight, eps)


def use_compiled_norms(module: nn.Module) -> int:
    """Make every RMSNorm of `module` run `rms_norm`; returns how many."""
    norms = [m for m in module.modules() if isinstance(m, RMSNorm)]
    for m in norms:
        m.kernel = rms_norm
    return len(norms)


def warm(module: nn.Module) -> list[str]:
    """Compile now what a first ordinary call of `module` would: one rms_norm call on zeros of MIN_ELEMENTS
    elements per (dtype, width) of its RMSNorms that run `rms_norm` and reach MIN_ELEMENTS within WARM_ROWS
    rows (the dynamic-shape kernel then serves every row count; a new dtype compiles once more). Returns
    those pairs as text, e.g. ["bfloat16 x 1280"]; [] when none qualifies (a tower on an accelerator or held
    by worker processes, or narrow test towers: warming costs ~3.5 s per process even from Inductor's cache)."""
    norms = {}  # (dtype, width, eps, requires_grad): one of those norms (dynamo guards on each)
    for m in module.modules():
        w = m.weight if isinstance(m, RMSNorm) and m.kernel is rms_norm else None
        if w is not None and w.device.type != "meta" and w.shape[-1] * WARM_ROWS >= MIN_ELEMENTS:
            norms.setdefault((w.dtype, w.shape[-1], m.eps, w.requires_grad), m)
    done = []
    for (dtype, width, *_), m in sorted(norms.items(), key=lambda item: str(item[0])):
        with torch.inference_mode():  # as towers run: dynamo guards on the grad mode too
            rms_norm(torch.zeros(-(-MIN_ELEMENTS // width), width, dtype=dtype, device=m.weight.device), m.weight,
                     m.eps)
        text = f"{str(dtype).removeprefix('torch.')} x {width}"
        done += [text] if text not in done else []
    return done
