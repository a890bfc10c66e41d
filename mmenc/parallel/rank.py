"""One rank of a process group (a torchrun process, or a worker mmenc spawned): build its tower, run.

The parallel layer knows the tower only through a `TowerRecipe` that the caller supplies (the
engine's is `mmenc.engine.tower.TowerRecipe`): nothing here imports the engine, and a spawned
worker receives the recipe pickled.

Torchrun (SPMD): every rank calls `run_rank_tower` with the same full pack. Weights mode: each rank
runs the whole pack through its shard. Data mode: the same path as the worker processes take
(mmenc.parallel.data): assign -> this rank's sub-pack -> run -> all-gather the pieces ->
`merge_outputs`. `check_same_call` verifies first that every rank holds the same call.
"""
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from mmenc.models.base import TowerOutput
from mmenc.parallel.data import (assign_images, flatten_output, merge_outputs, pack_for_rank, patch_counts,
                                 unflatten_output)


class TowerRecipe(Protocol):
    """How to build and run one tower; picklable (workers receive it)."""

    def tp_mode(self, mode: str, world: int) -> tuple[str, str | None]:
        """("weights" | "data", reason it fell back to data or None) for `world` ranks."""

    def build(self, device: torch.device) -> Any:
        """This rank's tower on `device`, sharded over the current TP group (parallel_state) if one is set.
        The result has `.device`, `.dtype` and `.output_tokens(grid_thw) -> list[int]`."""

    def run(self, built: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        """pixel_values [P, F], grid_thw int64 [N >= 1, 3] -> TowerOutput on built.device, image order."""


def build_rank_tower(recipe: TowerRecipe, mode: str, device: torch.device | str) -> Any:
    """On every rank of the default group: set the TP group (weights mode: the whole world; data
    mode: none) and build this rank's tower on `device`. `mode` is already resolved (recipe.tp_mode)."""
    from mmenc.distributed import parallel_state

    world = dist.get_world_size()
    parallel_state.set_tp_group(dist.group.WORLD if mode == "weights" and world > 1 else None)
    return recipe.build(torch.device(device))


def run_rank_tower(recipe: TowerRecipe, built: Any, pixel_values: torch.Tensor, grid_thw: torch.Tensor,
                   mode: str) -> TowerOutput:
    """Every rank calls this with the same full pack (pixel_values on CPU or this rank's device,
    grid_thw int64 [N >= 1, 3]); every rank returns the full TowerOutput on its device, image order."""
    if mode == "weights":
        return recipe.run(built, pixel_values, grid_thw)
    return run_data_parallel(lambda pv, g: recipe.run(built, pv, g), pixel_values, grid_thw,
                             built.output_tokens(grid_thw), device=built.device)


def run_data_parallel(run: Callable[[torch.Tensor, torch.Tensor], TowerOutput], pixel_values: torch.Tensor,
                      grid_thw: torch.Tensor, tokens_per_image: Sequence[int],
                      group: "dist.ProcessGroup | None" = None, device: torch.device | str | None = None
                      ) -> TowerOutput:
    """Data mode on one rank of `group` (every rank calls it with the same full pack): run this
    rank's images with `run(pixel_values, grid_thw)`, gather, return the full output in input order.
    `device`: where this rank's sub-pack goes before `run` (default: where pixel_values is)."""
    if grid_thw.shape[0] == 0:
        raise ValueError("run_data_parallel needs at least one image (grid_thw [N >= 1, 3]); the Encoder "
                         "answers an empty call itself")
    assignment = assign_images(patch_counts(grid_thw), dist.get_world_size(group))
    mine = assignment[dist.get_rank(group)]
    device = pixel_values.device if device is None else torch.device(device)
    local = run(*pack_for_rank(pixel_values, grid_thw, mine, device)) if mine else None
    return gather_outputs(local, assignment, tokens_per_image, group, device)


def gather_outputs(local: TowerOutput | None, assignment: Sequence[Sequence[int]],
                   tokens_per_image: Sequence[int], group: "dist.ProcessGroup | None" = None,
                   device: torch.device | str | None = None) -> TowerOutput:
    """Every rank's piece (`gather_pieces`), merged into input order with `merge_outputs`."""
    return merge_outputs(gather_pieces(local, assignment, tokens_per_image, group, device), assignment,
                         tokens_per_image)


def gather_pieces(local: TowerOutput | None, assignment: Sequence[Sequence[int]], tokens_per_image: Sequence[int],
                  group: "dist.ProcessGroup | None" = None, device: torch.device | str | None = None
                  ) -> list[TowerOutput | None]:
    """All-gather every rank's output over `group` (tensor collectives, padded to the largest rank):
    one TowerOutput per rank (None for a rank with no images). `local` is None on a rank with no
    images; `device` is where such a rank allocates (the collective's device)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = [sum(tokens_per_image[i] for i in imgs) for imgs in assignment]
    spec = None
    if local is not None:
        flat, skeleton = flatten_output(local, counts[rank])
        spec = ([(tuple(t.shape[1:]), t.dtype) for t in flat], skeleton)
    if any(not imgs for imgs in assignment):  # empty ranks do not know the output's layout: ask
        specs = [None] * world
        dist.all_gather_object(specs, spec, group=group)
        spec = next(s for s in specs if s is not None)  # merge_outputs' caller holds >= 1 image
    shapes, skeleton = spec
    if local is None:
        flat = [torch.empty(0, *shape, dtype=dtype, device=device) for shape, dtype in shapes]
    pad = max(counts)
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(world)]
    for t in flat:
        send = t if t.shape[0] == pad else torch.cat([t, t.new_zeros(pad - t.shape[0], *t.shape[1:])])
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send.contiguous(), group=group)
        for r, (p, n) in enumerate(zip(parts, counts)):
            per_rank[r].append(p[:n])
    return [unflatten_output(per_rank[r], skeleton) if assignment[r] else None for r in range(world)]


def call_fingerprint(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """float64 [6] summarising a call: image count, grid hash, shape, two sums of the pixels."""
    grid = tuple(torch.as_tensor(grid_thw).flatten().tolist())
    pv = pixel_values.detach()
    sums = [float(pv.sum(dtype=torch.float64)), float(pv[::7].abs().sum(dtype=torch.float64))] if pv.numel() else [0, 0]
    return torch.tensor([len(grid) // 3, hash(grid) % (1 << 50), *pv.shape[:2], *sums], dtype=torch.float64)


def check_same_call(pixel_values: torch.Tensor, grid_thw: torch.Tensor, device: torch.device | str,
                    group: "dist.ProcessGroup | None" = None) -> None:
    """Raise on every rank when the ranks of `group` were not called with the same pack (torchrun
    requires it: weights mode would all-reduce unrelated images together, data mode mix results)."""
    mine = call_fingerprint(pixel_values, grid_thw).to(device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    if any(not torch.equal(p, parts[0]) for p in parts):
        images = [int(p[0]) for p in parts]
        raise RuntimeError(f"under torchrun every rank must call the Encoder with the same inputs in the same order, "
                           f"but this call differs between ranks (images per rank: {images}); call it from one "
                           f"thread per rank with identical inputs. Nothing was computed")
