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
The weights are kept per (input, output) size in band form (`axis_taps`: each output's few taps), a
few kB each, and the dense matrix is built on the device per pass: a stream of images of many sizes
then sends a few kB per new size instead of a dense int16 matrix (up to megabytes, built on the host
while the tower ran; 2.8 ms of Python per axis in the scalar code this replaced).
"""
import functools
import math

import numpy as np
import torch

from mmenc.utils.device_copy import to_device


def _keys_cubic(x: np.ndarray) -> np.ndarray:
    """Keys' cubic (a = -0.5) at float64 offsets x, elementwise: the scalar formulas of torch's kernel."""
    a = -0.5
    x = np.abs(x)
    near = ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    far = ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=4096)
def axis_taps(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Fixed-point weights of one axis in band form: (first input column of each output int64 [out_size],
    int16 values as float64 [out_size, taps] (zero past an output's window), precision bits). Each
    output reads inputs first[i] .. first[i] + taps - 1 (those past the image have weight 0). Computed
    with the same float64 steps as torch's CPU kernel, vectorized over outputs (a 1036 -> 448 axis:
    about 0.2 ms); kept small (out_size x taps), so thousands of sizes fit the cache."""
    scale = in_size / out_size
    support = 2.0 * scale if scale >= 1.0 else 2.0
    taps = int(math.ceil(support)) * 2 + 1
    invscale = 1.0 / scale if scale >= 1.0 else 1.0
    center = scale * (np.arange(out_size, dtype=np.float64) + 0.5)
    first = np.maximum(np.trunc(center - support + 0.5), 0.0)
    count = np.clip(np.minimum(np.trunc(center + support + 0.5), in_size) - first, 0, taps)
    j = np.arange(taps, dtype=np.float64)
    inside = j[None, :] < count[:, None]
    ws = np.where(inside, _keys_cubic((j[None, :] + first[:, None] - center[:, None] + 0.5) * invscale), 0.0)
    total = np.zeros(out_size)
    for k in range(taps):  # left to right, as the kernel sums (the last bit of the sum matters)
        total = total + ws[:, k]
    normal = total != 0.0
    ws = np.where(normal[:, None], ws / np.where(normal, total, 1.0)[:, None], ws)
    wt_max = float(np.max(np.where(inside & normal[:, None], ws, 0.0), initial=0.0))
    precision = 0
    while precision < 22 and int(0.5 + wt_max * (1 << (precision + 1))) < (1 << 15):
        precision += 1
    v = ws * float(1 << precision)
    fixed = np.where(v < 0, np.trunc(v - 0.5), np.trunc(v + 0.5))
    return first.astype(np.int64), np.where(inside, fixed, 0.0), precision


def tap_columns(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """axis_taps with each tap's input column: (columns int64 [out_size, taps], clamped into the image;
    the weights float64 [out_size, taps]; precision). Clamped taps past the image carry weight 0, so
    adding them anywhere changes nothing."""
    first, fixed, precision = axis_taps(in_size, out_size)
    cols = np.minimum(first[:, None] + np.arange(fixed.shape[1])[None, :], in_size - 1)
    return cols, fixed, precision


def axis_weights(in_size: int, out_size: int) -> tuple[np.ndarray, int]:
    """axis_taps as a dense matrix: (int16 values as float64 [out_size, in_size], precision bits)."""
    cols, fixed, precision = tap_columns(in_size, out_size)
    mat = np.zeros((out_size, in_size), dtype=np.float64)
    np.add.at(mat, (np.arange(out_size)[:, None], cols), fixed)
    return mat, precision


@functools.lru_cache(maxsize=512)
def _device_taps(in_size: int, out_size: int, device: torch.device, stream: int
                 ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """tap_columns on `device`, each sent by one non-blocking copy. Kept per stream (`stream`: its id):
    a copy queued on one stream is only safe to read on that one (the Preprocessor stages on a side
    stream; `processor(images)` runs on the current one)."""
    cols, fixed, precision = tap_columns(in_size, out_size)
    return to_device(torch.from_numpy(cols), device), to_device(torch.from_numpy(fixed), device), precision


def band_to_dense(cols: torch.Tensor, fixed: torch.Tensor, in_size: int) -> torch.Tensor:
    """tap_columns' band (as tensors) -> the float64 [out_size, in_size] weight matrix, on the band's device."""
    dense = torch.zeros(cols.shape[0], in_size, dtype=torch.float64, device=cols.device)
    return dense.scatter_add_(1, cols, fixed)


def _pass(x: torch.Tensor, in_size: int, out_size: int) -> torch.Tensor:
    """float64 [..., in_size] holding uint8 values -> the same along the last axis, resized."""
    if x.device.type == "cpu":
        mat, precision = axis_weights(in_size, out_size)
        w = torch.from_numpy(mat)
    else:  # the dense matrix built on the device from the band: nothing large crosses or is cached
        stream = torch.cuda.current_stream(x.device).stream_id if x.device.type == "cuda" else 0
        cols, fixed, precision = _device_taps(in_size, out_size, x.device, stream)
        w = band_to_dense(cols, fixed, in_size)
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
