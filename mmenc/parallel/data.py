"""Data parallelism, once, for every tower: split a pack by image across ranks, merge back by index.

The one data-parallel path, used by the worker processes (mmenc.parallel.workers) and by torchrun
ranks (mmenc.parallel.rank) alike: `assign_images` -> `pack_for_rank` (each rank's sub-pack) -> run
-> `merge_outputs` (the pieces put back in input order; torchrun ranks first all-gather the pieces).

A pack is `pixel_values [P, C*tp*p*p]` (each image's t*h*w patch rows, images one after another)
with `grid_thw int64 [N, 3]`. In data mode every rank holds a full replica of the tower; the
images are assigned to ranks (`assign_images`), each rank runs its own sub-pack, and the outputs
are put back into input order (`merge_outputs`). Tower outputs are `TowerOutput`s whose
embeddings and tensor extras (a tensor, or a list of tensors, e.g. deepstack) are token-aligned:
[tokens, ...] with the image's `tower.output_tokens(grid_thw)` rows each, in image order.
"""
import itertools
from collections.abc import Sequence

import torch

from mmenc.models.base import TowerOutput


def patch_counts(grid_thw: torch.Tensor) -> list[int]:
    """Patch rows of each image in the pack: t*h*w. grid_thw int64 [N, 3] (CPU; columns after the third,
    LLaVA-NeXT's image size, do not count)."""
    return grid_thw[:, :3].prod(dim=-1).tolist()


def assign_images(patch_counts: Sequence[int], world: int) -> list[list[int]]:
    """Image indices per rank: largest image first, each to the rank with the fewest patches so far
    (ties: the smaller image index goes first, the lower rank wins). Each rank's list is ascending,
    so a rank's sub-pack keeps input order. Ranks may be empty when there are fewer images than ranks."""
    if world < 1:
        raise ValueError(f"world={world} must be >= 1")
    load, ranks = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(len(patch_counts)), key=lambda i: (-patch_counts[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += patch_counts[i]
        ranks[r].append(i)
    return [sorted(r) for r in ranks]


def pack_for_rank(pixel_values: torch.Tensor, grid_thw: torch.Tensor, images: Sequence[int],
                  device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                  out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sub-pack of `images` (ascending indices): (pixel_values [sum of their patches, ...] on
    `device` in `dtype` (defaults: pixel_values' own), grid_thw [k, 3]). Each image's rows are
    copied once, straight to `device`; a contiguous run of images on the same device and dtype is a
    view. `out`: write the rows there instead (a buffer of exactly that many rows; device and dtype
    are then out's)."""
    starts = [0, *itertools.accumulate(patch_counts(grid_thw))]
    if starts[-1] != pixel_values.shape[0]:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw describes {starts[-1]} patches")
    images = list(images)
    rows = sum(starts[i + 1] - starts[i] for i in images)
    if out is None:
        device = pixel_values.device if device is None else torch.device(device)
        dtype = pixel_values.dtype if dtype is None else dtype
        if images and images == list(range(images[0], images[-1] + 1)):  # a contiguous run
            run = pixel_values[starts[images[0]]:starts[images[-1] + 1]]
            return run.to(device=device, dtype=dtype, non_blocking=True), grid_thw[images]
        out = torch.empty(rows, *pixel_values.shape[1:], dtype=dtype, device=device)
    elif tuple(out.shape) != (rows, *pixel_values.shape[1:]):
        raise ValueError(f"out has shape {tuple(out.shape)}; images {images} need {(rows, *pixel_values.shape[1:])}")
    offset = 0
    for i in images:
        n = starts[i + 1] - starts[i]
        out[offset:offset + n].copy_(pixel_values[starts[i]:starts[i + 1]], non_blocking=True)
        offset += n
    return out, grid_thw[images]


def split_pack(pixel_values: torch.Tensor, grid_thw: torch.Tensor,
               world: int) -> tuple[list[list[int]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(assignment, one (pixel_values, grid_thw) sub-pack per rank); see `assign_images`."""
    assignment = assign_images(patch_counts(grid_thw), world)
    return assignment, [pack_for_rank(pixel_values, grid_thw, imgs) for imgs in assignment]


def restore_order(assignment: Sequence[Sequence[int]], tokens_per_image: Sequence[int]) -> torch.Tensor:
    """Row index such that cat(rank outputs)[index] is in input image order. int64 [tokens]."""
    starts, offset = {}, 0
    for imgs in assignment:
        for i in imgs:
            starts[i] = offset
            offset += tokens_per_image[i]
    return torch.cat([torch.arange(starts[i], starts[i] + n) for i, n in enumerate(tokens_per_image)]
                     or [torch.zeros(0, dtype=torch.long)])


def flatten_output(out: TowerOutput, tokens: int) -> tuple[list[torch.Tensor], dict]:
    """Token-aligned tensors [embeddings, extras...] and a skeleton to rebuild the extras."""
    flat, skeleton = [out.embeddings], {}
    for key, value in out.extras.items():
        if isinstance(value, torch.Tensor):
            skeleton[key] = ("tensor", len(flat))
            flat.append(value)
        elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
            skeleton[key] = (type(value).__name__, list(range(len(flat), len(flat) + len(value))))
            flat.extend(value)
        else:
            skeleton[key] = ("value", value)  # not token-aligned: passed through from one rank
    for t in flat:
        if t.shape[0] != tokens:
            raise ValueError(f"a tower output tensor has {t.shape[0]} rows; expected {tokens} (token-aligned, "
                             f"as TowerOutput requires of embeddings and tensor extras)")
    return flat, skeleton


def unflatten_output(flat: list[torch.Tensor], skeleton: dict) -> TowerOutput:
    extras = {}
    for key, (kind, where) in skeleton.items():
        if kind == "tensor":
            extras[key] = flat[where]
        elif kind == "value":
            extras[key] = where
        else:
            extras[key] = (tuple if kind == "tuple" else list)(flat[i] for i in where)
    return TowerOutput(embeddings=flat[0], extras=extras)


def merge_outputs(outputs: Sequence[TowerOutput | None], assignment: Sequence[Sequence[int]],
                  tokens_per_image: Sequence[int]) -> TowerOutput:
    """Per-rank outputs (rank r's covering assignment[r]; None for an empty rank) -> one TowerOutput
    in input image order. At least one image (a call with none never reaches the ranks)."""
    if not any(assignment):
        raise ValueError("merge_outputs needs at least one image; an empty pack has nothing to merge")
    present = [(o, sum(tokens_per_image[i] for i in imgs)) for o, imgs in zip(outputs, assignment) if imgs]
    flats = [flatten_output(o, n) for o, n in present]
    skeleton = flats[0][1]
    index = restore_order(assignment, tokens_per_image).to(flats[0][0][0].device)
    merged = [torch.cat([f[j] for f, _ in flats]).index_select(0, index) for j in range(len(flats[0][0]))]
    return unflatten_output(merged, skeleton)
