"""Two (or more) CPU processes over gloo, as torchrun would start them, checking that the tensor-
parallel ("weights") and data-parallel ("data") modes reproduce the single-process tower.

    port = free_port()
    torch.multiprocessing.spawn(check_modes_match, args=(2, port, cases), nprocs=2, join=True)

cases: [(checkpoint folder, pixel_values, grid_thw, single-process TowerOutput)], all checked in the
one process group, so a whole table of towers costs one spawn.
"""
import os

import torch
import torch.distributed as dist

from mmenc.testing.compare import assert_same_output
from mmenc.testing.processes import free_port  # noqa: F401  (MASTER_PORT; the SPMD tests import it from here)

MODES = ("weights", "data")


def check_modes_match(rank: int, world: int, port: int, cases: list, tol: float = 1e-5) -> None:
    """On each rank, what an Encoder launched by torchrun does: init_from_env, then per case and mode
    build this rank's tower, run the whole pack and compare with the single-process output."""
    from mmenc.distributed import init_from_env, leave_process_group, parallel_state
    from mmenc.engine.tower import TowerRecipe
    from mmenc.parallel import build_rank_tower, run_rank_tower

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    env = init_from_env(device_type="cpu")
    assert (env.rank, env.world_size, env.device.type) == (rank, world, "cpu")
    try:
        for folder, pixel_values, grid, want in cases:
            for mode in MODES:
                recipe = TowerRecipe(dict(model=folder, load_format="auto", dtype=torch.float32))
                loaded = build_rank_tower(recipe, mode, env.device)
                assert parallel_state.get_tp_size() == (world if mode == "weights" else 1)
                with torch.inference_mode():
                    got = run_rank_tower(recipe, loaded, pixel_values, grid, mode)
                assert_same_output(got, want, f"{mode} mode over {world} ranks, rank {rank}, "
                                              f"{loaded.hf_config['architectures'][0]}", tol)
        dist.barrier()  # no rank tears gloo down while the other still reads its last collective
    finally:
        leave_process_group()
