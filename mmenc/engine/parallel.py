"""Data parallelism, once, for every tower: split a pack by image across ranks, gather back in order.

A pack is `pixel_values [P, C*tp*p*p]` (each image's t*h*w patch rows, images one after another)
with `grid_thw int64 [N, 3]`. In data mode every rank holds a full replica of the tower; the
images are assigned to ranks (`assign_images`), each rank runs its own sub-pack, and the outputs
are gathered back into input order (`gather_outputs`). Tower outputs are `TowerOutput`s whose
embeddings and tensor extras (a tensor, or a list of tensors, e.g. deepstack) are token-aligned:
[tokens, ...] with the image's `tower.output_tokens(grid_thw)` rows each, in image order.
"""
import itertools
from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from mmenc.config import MultiModalConfig
from mmenc.models.base import TowerOutput


def resolve_tp_mode(mode: str, num_heads: int | None, world: int,
                    sizes: Mapping[str, int] | None = None) -> tuple[str, str | None]:
    """("weights" | "data", reason or None). Weights mode needs `num_heads` (and every size in
    `sizes`, e.g. {"intermediate_size": 3420}) divisible by `world`; otherwise data mode, with the
    reason to log. `mode` accepts the config's spellings ("weight" is an alias of "weights")."""
    mode = MultiModalConfig(mm_encoder_tp_mode=mode).mm_encoder_tp_mode
    if mode == "data" or world == 1:
        return mode, None
    for name, n in {**({"num_heads": num_heads} if num_heads is not None else {}), **(sizes or {})}.items():
        if n % world:
            return "data", (f"{name}={n} is not divisible by tensor_parallel_size={world}, so the tower cannot be "
                            f"sharded by weights; using mm_encoder_tp_mode='data' (a full replica per rank, "
                            f"images split across ranks)")
    return mode, None


def resolve_tower_tp_mode(mode: str, tower_args: Mapping, world: int) -> tuple[str, str | None]:
    """`resolve_tp_mode` for the tower `build_tower(**tower_args)` would give: built on the meta
    device (no memory, no weights read), its heads and every size its parallel linears split."""
    mode = MultiModalConfig(mm_encoder_tp_mode=mode).mm_encoder_tp_mode
    if mode == "data" or world == 1:
        return mode, None
    from mmenc.engine.runner import build_tower
    from mmenc.layers.linear import tp_sharded_sizes

    loaded = build_tower(**{**tower_args, "device": "meta"})
    return resolve_tp_mode(mode, getattr(loaded.config, "num_heads", None), world, tp_sharded_sizes(loaded.tower))


def patch_counts(grid_thw: torch.Tensor) -> list[int]:
    """Patch rows of each image in the pack: t*h*w. grid_thw int64 [N, 3] (CPU)."""
    return grid_thw.prod(dim=-1).tolist()


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


def _restore_order(assignment: Sequence[Sequence[int]], tokens_per_image: Sequence[int]) -> torch.Tensor:
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
    in input image order."""
    present = [(o, sum(tokens_per_image[i] for i in imgs)) for o, imgs in zip(outputs, assignment) if imgs]
    flats = [flatten_output(o, n) for o, n in present]
    skeleton = flats[0][1]
    index = _restore_order(assignment, tokens_per_image).to(flats[0][0][0].device)
    merged = [torch.cat([f[j] for f, _ in flats]).index_select(0, index) for j in range(len(flats[0][0]))]
    return unflatten_output(merged, skeleton)


def gather_outputs(local: TowerOutput | None, assignment: Sequence[Sequence[int]],
                   tokens_per_image: Sequence[int], group: "dist.ProcessGroup | None" = None,
                   device: torch.device | str | None = None) -> TowerOutput:
    """All-gather every rank's output over `group` (tensor collectives, padded to the largest rank)
    and restore input order; every rank returns the full TowerOutput. `local` is None on a rank
    with no images; `device` is where such a rank allocates (the collective's device)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    counts = [sum(tokens_per_image[i] for i in imgs) for imgs in assignment]
    if local is not None:
        flat, skeleton = flatten_output(local, counts[rank])
        spec = ([(tuple(t.shape[1:]), t.dtype) for t in flat], skeleton)
    if any(not imgs for imgs in assignment):  # empty ranks do not know the output's layout: ask
        specs = [None] * world
        dist.all_gather_object(specs, spec if local is not None else None, group=group)
        spec = next(s for s in specs if s is not None)
    shapes, skeleton = spec
    if local is None:
        flat = [torch.empty(0, *shape, dtype=dtype, device=device) for shape, dtype in shapes]
    pad = max(counts)
    gathered = []
    for t in flat:
        send = t if t.shape[0] == pad else torch.cat([t, t.new_zeros(pad - t.shape[0], *t.shape[1:])])
        parts = [torch.empty_like(send) for _ in range(world)]
        dist.all_gather(parts, send.contiguous(), group=group)
        gathered.append(torch.cat([p[:n] for p, n in zip(parts, counts)]))
    index = _restore_order(assignment, tokens_per_image).to(gathered[0].device)
    return unflatten_output([g.index_select(0, index) for g in gathered], skeleton)


def run_data_parallel(run: Callable[[torch.Tensor, torch.Tensor], TowerOutput], pixel_values: torch.Tensor,
                      grid_thw: torch.Tensor, tokens_per_image: Sequence[int],
                      group: "dist.ProcessGroup | None" = None, device: torch.device | str | None = None
                      ) -> TowerOutput:
    """Data mode on one rank of `group` (every rank calls it with the same full pack): run this
    rank's images with `run(pixel_values, grid_thw)`, gather, return the full output in input order.
    `device`: where this rank's sub-pack goes before `run` (default: where pixel_values is); only
    this rank's images are copied there."""
    assignment = assign_images(patch_counts(grid_thw), dist.get_world_size(group))
    mine = assignment[dist.get_rank(group)]
    device = pixel_values.device if device is None else torch.device(device)
    local = run(*pack_for_rank(pixel_values, grid_thw, mine, device)) if mine else None
    return gather_outputs(local, assignment, tokens_per_image, group, device)



def build_rank_tower(tower_args: Mapping, mode: str, device: torch.device | str):
    """On every rank of the default group (torchrun or a WorkerGroup worker): set the TP group
    (weights mode: the whole world; data mode: none) and build this rank's tower on `device`.
    `mode` must already be resolved (see `resolve_tower_tp_mode`). Returns the LoadedTower."""
    from mmenc.distributed import parallel_state
    from mmenc.engine.runner import build_tower

    world = dist.get_world_size()
    parallel_state.set_tp_group(dist.group.WORLD if mode == "weights" and world > 1 else None)
    return build_tower(**{**tower_args, "device": device})


def run_rank_tower(loaded, pixel_values: torch.Tensor, grid_thw: torch.Tensor, mode: str) -> TowerOutput:
    """Every rank calls this with the same full pack (pixel_values on CPU or this rank's device);
    every rank returns the full TowerOutput on its device, in input image order.
    Weights mode: each rank runs the whole pack through its shard. Data mode: `run_data_parallel`."""
    from mmenc.engine.runner import run_tower

    if mode == "weights":
        return run_tower(loaded, pixel_values, grid_thw)
    return run_data_parallel(lambda pv, g: run_tower(loaded, pv, g), pixel_values, grid_thw,
                             loaded.output_tokens(grid_thw), device=loaded.device)


def __getattr__(name: str):
    if name == "WorkerGroup":  # lives in engine/workers.py (process management); importable from here too
        from mmenc.engine.workers import WorkerGroup
        return WorkerGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
