"""torch's CPU uint8 antialiased bicubic resize, reproduced bit for bit on any device.

transformers' default (torchvision) processors resize uint8 images on the CPU with
`F.interpolate(..., mode="bicubic", antialias=True)`, whose uint8 kernel works in fixed point:
per axis, filter weights (Keys cubic, a=-0.5, PIL's support and centring) are normalised in
float64 and rounded to int16 at the largest precision at which the axis's largest weight still
fits; each output is an integer dot product plus half an LSB, shifted right by that precision and
clamped to 0..255. The width is resized first, into a uint8 intermediate, then the height; an
axis whose size does not change is skipped. On CUDA the same op runs in float32 instead and lands
up to ~16 levels away on noisy images.

`resize_uint8_exact` does the integer arithmetic as float64 matrix products (every partial sum
is an integer below 2**53, so the order of summation cannot change the result): the same bytes as
torch's CPU kernel, on the GPU. tests/test_preprocess_pipeline.py checks it against that kernel.
"""
import functools
import math

import numpy as np
import torch

from mmenc.preprocess.ops import to_device


def _keys_cubic(x: float) -> float:
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    if x < 2.0:
        return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return 0.0


@functools.lru_cache(maxsize=256)
def axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, int]:
    """Fixed-point weights of one axis: (int16 values as float64 [out_size, in_size], precision bits)."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    rows = []
    wt_max = 0.0
    for i in range(out_size):
        center = scale * (i + 0.5)
        xmin = max(int(center - support + 0.5), 0)
        xsize = min(max(min(int(center + support + 0.5), in_size) - xmin, 0), taps)
        ws = [_keys_cubic((j + xmin - center + 0.5) * invscale) for j in range(xsize)]
        total = 0.0
        for w in ws:
            total += w
        if total != 0.0:
            ws = [w / total for w in ws]
            wt_max = max([wt_max, *ws])
        rows.append((xmin, ws))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    mat = np.zeros((out_size, in_size), dtype=np.float64)
    for i, (xmin, ws) in enumerate(rows):
        for j, w in enumerate(ws):
            v = w * (1 << precision)
            mat[i, xmin + j] = int(-0.5 + v) if v < 0 else int(0.5 + v)
    return mat, precision


@functools.lru_cache(maxsize=32)
def _device_weights(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """axis_weights as int16 [out_size, in_size] kept on `device` (a 1600 -> 1092 axis: 3.5 MB)."""
    mat, precision = axis_weights(in_size, out_size)
    return to_device(torch.from_numpy(mat.astype(np.int16)), device), precision


def _pass(x: torch.Tensor, in_size: int, out_size: int) -> torch.Tensor:
    """float64 [..., in_size] holding uint8 values -> the same along the last axis, resized."""
    if x.device.type == "cpu":
        mat, precision = axis_weights(in_size, out_size)
        w = torch.from_numpy(mat)
    else:
        w16, precision = _device_weights(in_size, out_size, x.device)
        w = w16.double()
    acc = x @ w.T + float(1 << (precision - 1))
    return torch.floor_(acc / float(1 << precision)).clamp_(0, 255)


def resize_uint8_exact(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 [..., C, H, W] on any device -> uint8 [..., C, height, width], equal to torch's CPU
    `F.interpolate(images, (height, width), mode="bicubic", antialias=True)` byte for byte."""
    if images.dtype != torch.uint8:
        raise ValueError(f"resize_uint8_exact needs uint8 images, got {images.dtype}; pass the decoded image")
    h0, w0 = images.shape[-2:]
    if (h0, w0) == (height, width):
        return images
    x = images.double()
    if w0 != width:
        x = _pass(x, w0, width)
    if h0 != height:
        x = _pass(x.transpose(-1, -2), h0, height).transpose(-1, -2)
    return x.to(torch.uint8).contiguous()
