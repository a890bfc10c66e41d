"""Host-side helpers for towers that take `grid_thw`: reading the grid once (caches: mmenc.utils.lru).

Everything a tower derives from the grid (rotary tables, window permutations, cu_seqlens) is computed
on the host from the CPU `grid_thw`, once per forward, and cached per (t, h, w) or per whole grid.
"""
import torch

Grid = tuple[tuple[int, int, int], ...]


def read_grid(grid_thw: torch.Tensor, merge_size: int = 1) -> Grid:
    """grid_thw int [N, 3] (t, h, w in patches; on CPU, so no device sync) -> ((t, h, w), ...).

    Raises ValueError naming the row when a value is not positive or h, w are not multiples of
    `merge_size`.
    """
    if grid_thw.dim() != 2 or grid_thw.shape[-1] != 3:  # [N, 5] anyres rows: their tower's read_grid
        raise ValueError(f"grid_thw has shape {tuple(grid_thw.shape)}; expected [N, 3] rows of (t, h, w)")
    if grid_thw.dtype.is_floating_point:
        raise ValueError(f"grid_thw has dtype {grid_thw.dtype}; expected an integer tensor (int64)")
    grid = tuple((int(t), int(h), int(w)) for t, h, w in grid_thw.tolist())
    for i, (t, h, w) in enumerate(grid):
        if min(t, h, w) <= 0 or h % merge_size or w % merge_size:
            raise ValueError(f"grid_thw[{i}] = {(t, h, w)}: expected positive t, h, w with h and w multiples of "
                             f"the spatial merge size {merge_size}")
    return grid


def num_patches(grid: Grid) -> int:
    return sum(t * h * w for t, h, w in grid)


def frame_lengths(grid: Grid) -> list[int]:
    """Patches per frame, frame by frame: each frame attends to itself (h*w tokens, t times)."""
    return [h * w for t, h, w in grid for _ in range(t)]
