"""Linear (matmul) kernel backends, the way attention has them: the platform chooses
(Platform.get_linear_backend), the user may override (MultiModalConfig.linear_backend), models never
name one. The layers (mmenc.layers.linear_kernels.prepare_linears) hand each weight to the chosen backend once
after loading and call it on every forward.

    enum.py      LinearBackendEnum (+ from_name)
    base.py      the contract: reasons / prepare -> LinearState / apply
    native.py    NATIVE: F.linear, the reference
    onednn.py    ONEDNN: oneDNN with the weight packed once (CPU)
    fp8.py       FP8: e4m3 weights per channel, activations per token, torch._scaled_mm (CUDA sm89+)
    aligned.py   ALIGNED: F.linear with the input width zero-padded to 16-byte rows (CUDA's default)
    registry.py  enum -> file
"""
from mmenc.backends.linear.base import QUANTIZATIONS, LinearBackend, LinearState
from mmenc.backends.linear.enum import LinearBackendEnum
from mmenc.backends.linear.registry import (get_linear_backend_class, register_linear_backend,
                                            registered_linear_backends)

__all__ = ["LinearBackend", "LinearBackendEnum", "LinearState", "QUANTIZATIONS", "get_linear_backend_class",
           "register_linear_backend", "registered_linear_backends"]
