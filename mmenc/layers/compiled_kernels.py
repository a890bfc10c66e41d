"""Elementwise layers through Inductor-compiled kernels, for CPUs: torch's eager form of these is a chain of
unfused ops, each a pass over memory.

- RMSNorm: square, mean, rsqrt, two multiplies, a cast; about 6x the time of torch's layer_norm. One
  [5476, 1280] row block (Qwen2.5-VL-7B at 1 x 1036 px), one thread, on this project's Xeon with AMX: bf16
  17.2 ms eager, 2.1 ms compiled; float32 15.9 ms against 3.6 ms; the same values to 1e-7 (float32).
- QuickGELU (x * sigmoid(1.702 x): CLIP, LLaVA-1.5 / NeXT, Qwen2-VL): three passes. One [2308, 4096] bf16
  block (CLIP ViT-L/14-336's fc1 output for 4 images), 2 threads: 7.0 ms eager, 3.7 ms compiled.

    use_compiled_kernels(module) -> int  every RMSNorm and QuickGELU of `module` runs its compiled kernel
    rms_norm(x, weight, eps), quick_gelu(x)  the layers' results; compiled once per process (dynamic shapes)
    warm(module) -> list[str]            compile now what a first ordinary call of `module` would

Inputs smaller than MIN_ELEMENTS run the eager form (nothing to win there, and the tiny towers of the test
suite never compile). The first large call compiles (a few seconds; Inductor keeps it in its on-disk cache);
a server calls `warm` at load so that its first request does not pay it. Where compiling fails (no C++
compiler, an Inductor error) the failure is logged once and the eager form runs from then on. The platform
decides where this runs (Platform.compiles_elementwise); the engine leaves it off when the whole tower is
compiled (Inductor fuses these there itself) and in batch-invariant mode.
"""
import threading
from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from mmenc.layers.activation import QuickGELU
from mmenc.layers.norm import RMSNorm
from mmenc.logger import init_logger

logger = init_logger(__name__)

MIN_ELEMENTS = 1 << 18  # x.numel() from which a compiled kernel runs
WARM_ROWS = 1024  # warm() compiles for layers that reach MIN_ELEMENTS within one 448 px Qwen image's patches


class CompiledKernel:
    """`reference(x, *args)` compiled by Inductor once per process (dynamic=True) for x of MIN_ELEMENTS or
    more, the reference itself below that, inside a compiled graph, and after a failure (logged once)."""

    def __init__(self, name: str, reference: Callable[..., torch.Tensor]):
        self.name, self.reference = name, reference
        self._lock = threading.Lock()
        self.fn: Callable | None = None  # the compiled function, made at the first large call
        self.failed = False

    def _compiled(self) -> Callable | None:
        fn = self.fn  # read without the lock on the hot path: the lock only guards its creation
        if fn is not None:
            return fn
        with self._lock:
            if self.fn is None and not self.failed:
                self.fn = torch.compile(self.reference, dynamic=True)
            return self.fn

    def __call__(self, x: torch.Tensor, *args) -> torch.Tensor:
        if x.numel() < MIN_ELEMENTS or self.failed or torch.compiler.is_compiling():
            return self.reference(x, *args)
        fn = self._compiled()
        if fn is None:
            return self.reference(x, *args)
        try:
            return fn(x, *args)
        except Exception as e:  # noqa: BLE001 - any compile failure: the reference, said once
            with self._lock:
                self.failed, self.fn = True, None
            logger.warning("compiled %s unavailable (%s: %s); running torch's eager form", self.name,
                           type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "")
            return self.reference(x, *args)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


rms_norm = CompiledKernel("RMSNorm", _rms_norm)  # F.rms_norm(x, (D,), weight, eps) for x [..., D]
quick_gelu = CompiledKernel("QuickGELU", _quick_gelu)  # QuickGELU's x * sigmoid(1.702 x)


def use_compiled_kernels(module: nn.Module) -> int:
    """Make every RMSNorm and QuickGELU of `module` run its compiled kernel; returns how many."""
    count = 0
    for m in module.modules():
        if isinstance(m, (RMSNorm, QuickGELU)):
            m.kernel = rms_norm if isinstance(m, RMSNorm) else quick_gelu
            count += 1
    return count


def warm(module: nn.Module) -> list[str]:
    """Compile now what a first ordinary call of `module` would, in inference mode as towers run (dynamo
    guards on it): one call on zeros of MIN_ELEMENTS elements per dtype and width of its RMSNorms that run
    `rms_norm` and reach MIN_ELEMENTS within WARM_ROWS rows, and per dtype of its QuickGELUs when its widest
    linear does (the dynamic-shape kernels then serve every row count). Returns what it compiled as text,
    e.g. ["RMSNorm bfloat16 x 1280"]; [] when nothing qualifies (a tower on an accelerator or held by worker
    processes, or narrow test towers: warming costs ~3.5 s per process even from Inductor's cache)."""
    params = [p for p in module.parameters() if p.device.type != "meta"]
    if not params:
        return []
    widest = max((p.shape[0] for p in params if p.dim() == 2), default=0)
    calls: dict[tuple, tuple[str, Callable[[], torch.Tensor]]] = {}  # dynamo's guards -> (what, the call)
    for m in module.modules():
        if isinstance(m, RMSNorm) and m.kernel is rms_norm and m.weight.shape[-1] * WARM_ROWS >= MIN_ELEMENTS:
            w = m.weight  # the module's own weight: dynamo guards on its dtype and requires_grad too
            calls.setdefault(("norm", w.dtype, w.shape[-1], m.eps, w.requires_grad), (
                f"RMSNorm {_name(w.dtype)} x {w.shape[-1]}", lambda w=w, eps=m.eps: rms_norm(
                    torch.zeros(-(-MIN_ELEMENTS // w.shape[-1]), w.shape[-1], dtype=w.dtype, device=w.device), w, eps)))
        elif isinstance(m, QuickGELU) and m.kernel is quick_gelu and widest * WARM_ROWS >= MIN_ELEMENTS:
            p = params[0]  # the tower's dtype, which its activations have
            calls.setdefault(("quick_gelu", p.dtype), (f"QuickGELU {_name(p.dtype)}", lambda p=p: quick_gelu(
                torch.zeros(-(-MIN_ELEMENTS // widest), widest, dtype=p.dtype, device=p.device))))
    done: list[str] = []
    with torch.inference_mode():
        for what, call in calls.values():
            call()
            done += [what] if what not in done else []
    return done


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
