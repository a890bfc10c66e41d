"""Joining a process group: from a launcher's environment (torchrun, one process per device,
several machines included) or as a worker that mmenc spawned itself (mmenc/parallel/workers.py)."""
import dataclasses
import datetime
import gc
import os

import torch
import torch.distributed as dist

from mmenc.logger import init_logger

logger = init_logger(__name__)


@dataclasses.dataclass(frozen=True)
class DistEnv:
    """This process's place in the default process group."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def launched_distributed() -> bool:
    """True when a launcher (torchrun) set RANK and WORLD_SIZE for more than one process."""
    return "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(f"local rank {local_rank} needs CUDA device {local_rank}, but this machine shows {count} "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); launch at most "
                             f"{count} processes per machine")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device(device_type)


def init_process_group(rank: int, world_size: int, local_rank: int, device_type: str,
                       store: "dist.Store | None" = None, timeout_s: float = 600.0) -> DistEnv:
    """Initialise the default group (NCCL on CUDA, gloo otherwise) and pin this process to its device.
    With `store` None the rendezvous comes from MASTER_ADDR/MASTER_PORT (env://)."""
    device = _device(device_type, local_rank)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    return DistEnv(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def init_from_env(device_type: str | None = None, timeout_s: float = 600.0) -> DistEnv | None:
    """Join the group a launcher describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT,
    as torchrun sets them); None when not launched distributed. An already initialised default
    group is reused. `device_type` defaults to "cuda" when CUDA is available, else "cpu"; each
    process uses device LOCAL_RANK.

    Every rank then runs the same program (SPMD): in weights mode set the TP group to the world
    (`parallel_state.set_tp_group(dist.group.WORLD)`) and run the full pack on every rank; in data
    mode call `mmenc.parallel.run_data_parallel` on every rank with the same pack."""
    if not launched_distributed() and not dist.is_initialized():
        return None
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
    world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    env = init_process_group(rank, world, local_rank, device_type, timeout_s=timeout_s)
    logger.info("rank %d of %d (local rank %d) on %s", env.rank, env.world_size, local_rank, env.device)
    return env


def leave_process_group() -> None:
    """Undo init_process_group on this rank: clear the tensor-parallel group and destroy the default
    group. Garbage is collected on both sides of the destroy so no collective's leftover object
    outlives the group into interpreter exit (with gloo on CPU, such leftovers aborted the process
    at exit, "terminate called without an active exception", in about one run of five)."""
    from mmenc.distributed import parallel_state

    parallel_state.set_tp_group(None)
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()
        gc.collect()
