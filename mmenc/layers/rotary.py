"""2-D rotary position embedding for vision tokens (Qwen2-VL family, GLM-4.1V, MoonViT style).

Each head of size D rotates D/2 pairs: D/4 frequencies for the token's row and D/4 for its column,
inv_freq[i] = theta ** (-4i / D). Tables are float32 cos/sin [tokens, D], computed once per forward
on the device from host-built positions (cached per (h, w)); the same table serves every layer.

Two layouts:
  split (interleaved=False): angles = [row*f | col*f], cos = [angles | angles], rotate_half pairs
      (x_i, x_{i+D/2}) -- Qwen2-VL / Qwen2.5-VL / Qwen3-VL.
  interleaved=True: angles alternate per frequency (row_0, col_0, row_1, ...), adjacent pairs
      (x_{2i}, x_{2i+1}) rotate -- complex-number style (MoonViT; pass col_first=True for x before y).

Frequencies: by default the row and column axes share inv_freq above; with axis_freqs="alternate"
(Pixtral) the D/2 frequencies theta ** (-2i / D) are dealt out alternately, the even ones to the
row axis and the odd ones to the column axis.
"""
import torch

from mmenc.layers.grid import Grid
from mmenc.utils.device_copy import to_device
from mmenc.utils.lru import LRUCache


def vision_inv_freq(head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    """float32 [head_dim // 4]: the frequencies shared by the row and column axes."""
    if head_dim % 4:
        raise ValueError(f"2-D rotary needs head_dim divisible by 4, got head_dim={head_dim}")
    half = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))


def axis_inv_freq(head_dim: int, theta: float = 10000.0, axis_freqs: str = "shared") -> torch.Tensor:
    """float32 [2, head_dim // 4]: the row axis' frequencies, then the column axis'.

    "shared": both rows are `vision_inv_freq`; "alternate": the head_dim // 2 frequencies
    theta ** (-2i / head_dim), even i for rows and odd i for columns (Pixtral's axial rope).
    """
    if axis_freqs == "shared":
        return vision_inv_freq(head_dim, theta).expand(2, -1).clone()
    if axis_freqs == "alternate":
        vision_inv_freq(head_dim, theta)  # the head_dim check
        full = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))  # [D/2]
        return torch.stack([full[0::2], full[1::2]])
    raise ValueError(f"axis_freqs={axis_freqs!r} is not known; expected 'shared' or 'alternate'")


def grid_positions(h: int, w: int, merge_size: int = 1) -> torch.Tensor:
    """(row, col) int64 [h*w, 2] of one frame's patches in the order the tower holds them:
    merge-block-major (each merge_size x merge_size block of patches contiguous, blocks in raster
    order), which is raster order for merge_size 1."""
    m = merge_size
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    # [h/m, m, w/m, m] -> [h/m, w/m, m, m]: blocks in raster order, patches inside a block in raster order
    rows = rows.permute(0, 2, 1, 3).reshape(-1)
    cols = cols.permute(0, 2, 1, 3).reshape(-1)
    return torch.stack([rows, cols], dim=-1)


class VisionRotary2D:
    """cos/sin tables for a pack of images: `tables(grid, device) -> (cos, sin)` float32 [T, head_dim].

    Tokens are ordered image by image, frame by frame, patches as `grid_positions(h, w, merge_size)`.
    The (row, col) positions are built on the host and cached per (h, w); the tables are computed on
    the target device from them (one small host-to-device copy, no device-to-host sync). A tower
    that reorders tokens (window attention) permutes the positions on the host and calls
    `cos_sin(positions.to(device))`.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0, merge_size: int = 1, interleaved: bool = False,
                 col_first: bool = False, cache_size: int = 256, axis_freqs: str = "shared"):
        self.head_dim, self.merge_size = head_dim, merge_size
        self.interleaved, self.col_first = interleaved, col_first
        self.inv_freq = axis_inv_freq(head_dim, theta, axis_freqs)  # [2, D/4]: (first axis, second axis)
        self._inv_freq_on: dict[str, torch.Tensor] = {}
        self._frames = LRUCache(cache_size)

    def frame_positions(self, h: int, w: int) -> torch.Tensor:
        """(row, col) int64 [h*w, 2] of one frame, on the host, cached."""
        return self._frames.get((h, w), lambda: grid_positions(h, w, self.merge_size))

    def positions(self, grid: Grid) -> torch.Tensor:
        """(row, col) int64 [T, 2] for every patch of the pack, on the host."""
        parts = [self.frame_positions(h, w).repeat(t, 1) for t, h, w in grid]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """positions int [T, 2] (row, col) -> float32 angles [T, head_dim // 2] in this layout, on
        the positions' device."""
        key = str(positions.device)
        if key not in self._inv_freq_on:
            self._inv_freq_on[key] = self.inv_freq.to(positions.device)
        pos = positions.flip(-1) if self.col_first else positions
        freqs = pos.to(torch.float32)[:, :, None] * self._inv_freq_on[key]  # [T, 2, D/4] (axis, frequency)
        if self.interleaved:
            return freqs.transpose(1, 2).reshape(pos.shape[0], -1)  # a0, b0, a1, b1, ...
        return freqs.reshape(pos.shape[0], -1)  # a0..a_{D/4-1}, b0..b_{D/4-1}

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int [T, 2] -> cos, sin float32 [T, head_dim], laid out for `apply_rotary`."""
        angles = self.angles(positions)
        full = angles.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([angles, angles], dim=-1)
        return full.cos(), full.sin()

    def tables(self, grid: Grid, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos_sin(to_device(self.positions(grid), device))


def _rotate(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if interleaved:  # (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)
        pairs = x.unflatten(-1, (-1, 2))
        return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x [T, ..., D] (any heads in between), cos/sin float32 [T, D] -> x rotated, in x's dtype.

    The rotation runs in float32, as the reference implementations do. Eagerly, two float32 copies of x
    are alive at most (x's and its rotated halves', multiplied in place), not four: the same products and
    sum, so the same bits (GLM-OCR on 8 pages: q and k stacked, 0.45 GiB per float32 copy).
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    xf = x.to(torch.float32, copy=True)  # its own storage, also for a float32 x: multiplied in place below
    rotated = _rotate(xf, interleaved).mul_(sin.view(shape))
    out = xf.mul_(cos.view(shape)).add_(rotated)
    del rotated
    return out.to(x.dtype)
