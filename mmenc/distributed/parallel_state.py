"""Tensor-parallel state: which rank this process is and the group it shards the tower over.

With no group set (one process) the size is 1 and the collectives are no-ops.
"""
import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_TP_GROUP: "dist.ProcessGroup | None" = None


def set_tp_group(group: "dist.ProcessGroup | None") -> None:
    """Set the group the tower's weights are sharded over (None: unsharded)."""
    global _TP_GROUP
    _TP_GROUP = group


@contextlib.contextmanager
def tp_group(group: "dist.ProcessGroup | None") -> Iterator[None]:
    """Within the block the tower shards over `group` (None: unsharded); the group before is restored."""
    before = _TP_GROUP
    set_tp_group(group)
    try:
        yield
    finally:
        set_tp_group(before)


def get_tp_group() -> "dist.ProcessGroup | None":
    return _TP_GROUP


def get_tp_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def get_tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel group, in place; returns it."""
    if get_tp_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` (same shape on each) along `dim`, in rank order."""
    if get_tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(get_tp_size())]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
