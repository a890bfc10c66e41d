"""Encoder under a torchrun-style launch (RANK/WORLD_SIZE/LOCAL_RANK set, one process per device):
every rank builds the same Encoder, calls it with the same pack and gets the single-process result,
in weights and data mode (gloo, 2 CPU processes)."""
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmenc.testing.checkpoints import random_pixels, save_qwen2_5_vl

GRID = torch.tensor([[1, 8, 12], [2, 4, 4], [1, 2, 2]])


def _rank_main(rank, world, port, folder, pixels, want, mode):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from mmenc.distributed import leave_process_group
    from mmenc.engine.encoder import Encoder

    try:
        enc = Encoder(folder, device="cpu", dtype="float32", mm_encoder_tp_mode=mode)
        assert enc.tensor_parallel_size == world
        got = enc.encode_pixels(pixels, GRID)
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, f"rank {rank}, {mode} mode: relative error {err:.2e} vs one process (tolerance 1e-5)"
        dist.barrier()
    finally:
        leave_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["weights", "data"])
def test_encoder_under_torchrun_matches_single_process(tmp_path, mode, monkeypatch):
    from mmenc.engine.encoder import Encoder

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    folder, _ = save_qwen2_5_vl(tmp_path / "ckpt")
    pixels = random_pixels(GRID)
    want = Encoder(str(folder), device="cpu", dtype="float32").encode_pixels(pixels, GRID)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, str(folder), pixels, want, mode), nprocs=2, join=True)
