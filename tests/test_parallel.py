"""Data/tensor-parallel engine: image assignment, order restoration, gloo gathers, and the worker group
(weights and data mode equal the single-process tower; guards: device count, dead / hung workers, shutdown).
Every tower family in torchrun-style weights and data modes: test_towers_generic.py."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmenc.engine.tower import TowerRecipe
from mmenc.models.base import TowerOutput
from mmenc.parallel import (assign_images, gather_outputs, merge_outputs, pack_for_rank, patch_counts, resolve_tp_mode,
                            run_data_parallel, split_pack)
from mmenc.testing.compare import assert_same_output

TOL = 1e-5


def _same_output(got: TowerOutput, want: TowerOutput, what: str) -> None:
    assert_same_output(got, want, what, TOL)


# ---- pure functions ----

def test_assign_images_largest_first_to_least_loaded():
    assert assign_images([10, 50, 20, 30, 40], 2) == [[0, 1, 2], [3, 4]]  # 50,20,10 | 40,30
    assert assign_images([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]  # ties: lower index first, lower rank wins
    assert assign_images([7], 3) == [[0], [], []]
    assert assign_images([], 2) == [[], []]
    assert assign_images([3, 1, 2], 1) == [[0, 1, 2]]
    counts = [int(x) for x in torch.randint(1, 1000, (40,), generator=torch.Generator().manual_seed(0))]
    ranks = assign_images(counts, 4)
    assert sorted(i for r in ranks for i in r) == list(range(40))
    loads = [sum(counts[i] for i in r) for r in ranks]
    assert max(loads) - min(loads) <= max(counts), loads  # greedy LPT bound
    assert assign_images(counts, 4) == ranks  # deterministic


def test_assign_images_rejects_bad_world():
    with pytest.raises(ValueError, match="world=0"):
        assign_images([1, 2], 0)


def test_resolve_tp_mode():
    assert resolve_tp_mode("weights", 16, 2) == ("weights", None)
    assert resolve_tp_mode("weight", 16, 4) == ("weights", None)
    assert resolve_tp_mode("data", 16, 2) == ("data", None)
    assert resolve_tp_mode("weights", 3, 1) == ("weights", None)
    mode, reason = resolve_tp_mode("weights", 16, 3)
    assert mode == "data" and "num_heads=16 is not divisible by tensor_parallel_size=3" in reason
    mode, reason = resolve_tp_mode("weights", 16, 2, sizes={"intermediate_size": 3421})
    assert mode == "data" and "intermediate_size=3421" in reason
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='rows'"):
        resolve_tp_mode("rows", 16, 2)


def _grid_and_pixels(seed=0):
    grid = torch.tensor([[1, 4, 4], [2, 4, 6], [1, 2, 2], [1, 6, 4], [1, 4, 2]])  # includes a 2-frame video
    pv = torch.randn(int(grid.prod(-1).sum()), 6, generator=torch.Generator().manual_seed(seed))
    return grid, pv


def _fake_tower(pv: torch.Tensor, grid: torch.Tensor) -> TowerOutput:
    """Per image: 4 patch rows merge into one token (like a 2x2 merger); extras like Qwen3-VL's deepstack."""
    emb = pv.reshape(-1, 24) @ torch.linspace(-1, 1, 24 * 5).reshape(24, 5)  # [tokens, 5]
    return TowerOutput(embeddings=emb, extras={"deepstack": [emb * 2, emb.square()], "scale": emb[:, :1],
                                               "note": "merged 2x2"})


def _tokens(grid):
    return [n // 4 for n in patch_counts(grid)]


@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_split_and_merge_restore_input_order(world):
    grid, pv = _grid_and_pixels()
    assignment, packs = split_pack(pv, grid, world)
    for imgs, (p, g) in zip(assignment, packs):
        assert g.tolist() == grid[imgs].tolist()
        assert p.shape[0] == sum(patch_counts(g))
    outputs = [_fake_tower(p, g) if imgs else None for imgs, (p, g) in zip(assignment, packs)]
    _same_output(merge_outputs(outputs, assignment, _tokens(grid)), _fake_tower(pv, grid), f"world={world}")


def test_pack_for_rank_rows_and_errors():
    grid, pv = _grid_and_pixels()
    starts = [0, 16, 64, 68, 92, 100]
    p, g = pack_for_rank(pv, grid, [1, 3])
    assert torch.equal(p, torch.cat([pv[16:64], pv[68:92]])) and g.tolist() == [[2, 4, 6], [1, 6, 4]]
    p, _ = pack_for_rank(pv, grid, [2, 3])
    assert p.data_ptr() == pv[starts[2]].data_ptr()  # contiguous images: a view, no copy
    with pytest.raises(ValueError, match="pixel_values has 99 rows but grid_thw describes 100 patches"):
        pack_for_rank(pv[:99], grid, [0])


# ---- gloo: gather_outputs / run_data_parallel in 2 processes ----

def _gather_worker(rank, world, init_file):
    from mmenc.distributed import leave_process_group
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for n_images in (5, 1):  # 1 image: rank 1 is empty
            grid, pv = _grid_and_pixels()
            grid = grid[:n_images]
            pv = pv[:sum(patch_counts(grid))]
            got = run_data_parallel(_fake_tower, pv, grid, _tokens(grid))
            _same_output(got, _fake_tower(pv, grid), f"rank {rank} images={n_images}")
        # explicit gather with an empty local output
        assignment = [[0], []]
        grid, pv = _grid_and_pixels()
        local = _fake_tower(*pack_for_rank(pv[:16], grid[:1], [0])) if rank == 0 else None
        got = gather_outputs(local, assignment, _tokens(grid[:1]), device="cpu")
        _same_output(got, _fake_tower(pv[:16], grid[:1]), "gather with empty rank")
        dist.barrier()  # no rank tears gloo down while the other still reads its last collective
    finally:
        leave_process_group()


@pytest.mark.slow
def test_run_data_parallel_gloo(tmp_path):
    mp.spawn(_gather_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


# ---- WorkerGroup: 2 CPU workers (gloo) on a tiny random-weight Qwen2.5-VL checkpoint ----

GRID = torch.tensor([[1, 8, 8], [2, 4, 8], [1, 4, 4], [1, 12, 8]])  # several sizes and a 2-frame video


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """(checkpoint folder, pixel_values, grid_thw, single-process TowerOutput)."""
    from mmenc.testing.checkpoints import random_pixels, save_qwen2_5_vl
    from mmenc.engine.tower import build_tower, run_tower

    folder, _ = save_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))
    pixel_values = random_pixels(GRID)
    loaded = build_tower(model=str(folder), load_format="auto", dtype=torch.float32, device="cpu")
    with torch.inference_mode():
        want = run_tower(loaded, pixel_values, GRID)
    return str(folder), pixel_values, GRID, want


def _group(folder, mode, **kwargs):
    from mmenc.parallel import WorkerGroup
    return WorkerGroup(2, TowerRecipe(dict(model=folder, load_format="auto", dtype=torch.float32)), mode=mode, device_type="cpu",
                       timeout_s=120, **kwargs)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _all_gone(pids, wait_s=10.0) -> bool:
    deadline = time.monotonic() + wait_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def _same_call_worker(rank, world, port):
    """Under torchrun every rank must make the same call: check_same_call passes for equal inputs and
    raises on every rank, before any tower work, when they differ."""
    from mmenc.distributed import init_from_env, leave_process_group
    from mmenc.parallel import check_same_call
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    env = init_from_env(device_type="cpu")
    try:
        pixel_values = torch.arange(int(GRID.prod(-1).sum()) * 8, dtype=torch.float32).reshape(-1, 8)
        check_same_call(pixel_values, GRID, env.device)  # the same call on both ranks: passes
        with pytest.raises(RuntimeError, match=r"every rank must call the Encoder with the same inputs"):
            check_same_call(pixel_values if rank == 0 else pixel_values + 1, GRID, env.device)
        with pytest.raises(RuntimeError, match=r"images per rank: \[4, 3\]"):
            check_same_call(pixel_values, GRID if rank == 0 else GRID[:3], env.device)
        dist.barrier()  # no rank tears gloo down while the other still reads its last collective
    finally:
        leave_process_group()


def test_torchrun_ranks_must_make_the_same_call():
    """(Modes against one process under torchrun, for every family: tests/test_towers_generic.py.)"""
    from mmenc.testing.spmd import free_port
    mp.spawn(_same_call_worker, args=(2, free_port()), nprocs=2, join=True)


def test_init_from_env_without_launcher_is_none(monkeypatch):
    from mmenc.distributed import init_from_env
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    assert init_from_env() is None


def test_results_travel_in_shared_memory_with_extras():
    from mmenc.parallel.transport import ShmEndpoint, ShmTransport, shared_copy
    grid, pv = _grid_and_pixels()
    out = ShmEndpoint().reply(_fake_tower(pv, grid))
    tensors = [out.embeddings, out.extras["scale"], *out.extras["deepstack"]]
    assert all(t.is_shared() for t in tensors) and out.extras["note"] == "merged 2x2"
    _same_output(out, _fake_tower(pv, grid), "shared copy")
    half = shared_copy(pv, torch.bfloat16)
    assert half.is_shared() and half.dtype == torch.bfloat16 and torch.equal(half, pv.to(torch.bfloat16))
    # inputs: each rank's images in shared memory in the tower's dtype; an already shared input is sent as is
    transport = ShmTransport(2, torch.device("cpu"))
    payloads = transport.send_inputs(pv, grid, [[1], [0]], torch.bfloat16)
    assert all(p["pixel_values"].is_shared() and p["pixel_values"].dtype == torch.bfloat16 for p in payloads)
    assert torch.equal(payloads[0]["pixel_values"], pack_for_rank(pv, grid, [1])[0].to(torch.bfloat16))
    whole = shared_copy(pv)
    every = list(range(grid.shape[0]))
    assert transport.send_inputs(whole, grid, [every, every], pv.dtype)[1]["pixel_values"] is whole


def test_group_rejects_more_ranks_than_devices():
    from mmenc.parallel import WorkerGroup
    n = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match=rf"world_size={n} needs {n} CUDA devices but {n - 1} are visible"):
        WorkerGroup(n, {}, mode="weights", device_type="cuda")
    with pytest.raises(ValueError, match=r"_fault=.*not valid"):
        WorkerGroup(2, {}, mode="data", device_type="cpu", _fault={"rank": 5, "at": "run", "action": "raise"})
    with pytest.raises(ValueError, match=r"device_type='tpu'"):
        WorkerGroup(2, {}, device_type="tpu")


@pytest.mark.slow
def test_weights_mode_matches_single_process_and_hang_times_out(tiny_model):
    folder, pv, grid, want = tiny_model
    group = _group(folder, "weights", _fault={"rank": 1, "at": "run", "action": "hang", "after": 2})
    with group:
        pids = group.pids
        _same_output(group.run(pv, grid), want, "weights mode")
        n = int(grid[:1].prod())
        _same_output(group.run(pv[:n], grid[:1]), TowerOutput(want.embeddings[:n // 4]), "weights mode, one image")
        with pytest.raises(TimeoutError, match=r"(?s)worker rank 1 did not answer within 3s during run \(hung\); "
                                               r"rank 0 waited for it in a collective.*--- rank 1 ---.*in _inject"):
            group.run(pv, grid, timeout_s=3)
        with pytest.raises(RuntimeError, match="closed"):
            group.run(pv, grid)
    assert _all_gone(pids), f"worker processes {pids} still alive after a timeout and close()"


@pytest.mark.slow
def test_data_mode_matches_single_process_and_worker_error_surfaces(tiny_model):
    folder, pv, grid, want = tiny_model
    group = _group(folder, "data", _fault={"rank": 1, "at": "run", "action": "raise", "after": 2})
    pids = group.pids
    _same_output(group.run(pv, grid), want, "data mode")
    n = int(grid[:1].prod())  # one image for two ranks: rank 1 idle
    _same_output(group.run(pv[:n], grid[:1]), TowerOutput(want.embeddings[:n // 4]), "data mode, one image")
    from mmenc.parallel import WorkerError
    with pytest.raises(WorkerError, match=r"(?s)worker rank 1 failed during run:.*Traceback.*"
                                          r"RuntimeError: injected fault on rank 1 at run"):
        group.run(pv, grid)
    assert _all_gone(pids), f"worker processes {pids} still alive after a worker error"
    group.close()  # idempotent


def test_resolve_tower_tp_mode_checks_every_sharded_size():
    args = dict(model="Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy", dtype=torch.bfloat16)
    resolve_tower_tp_mode = TowerRecipe(args).tp_mode
    assert resolve_tower_tp_mode("weights", 2) == ("weights", None)
    assert resolve_tower_tp_mode("data", 3) == ("data", None)
    mode, reason = resolve_tower_tp_mode("weights", 3)
    assert mode == "data" and "num_heads=16 is not divisible by tensor_parallel_size=3" in reason
    mode, reason = resolve_tower_tp_mode("weights", 8)  # 16 heads split, but not the MLP's 3420
    assert mode == "data" and "3420 is not divisible by tensor_parallel_size=8" in reason, reason


@pytest.mark.slow
def test_worker_exit_at_startup_is_reported_after_mode_fallback(tmp_path, mmenc_caplog):
    from mmenc.testing.checkpoints import save_qwen2_5_vl
    from mmenc.parallel import WorkerError
    folder, _ = save_qwen2_5_vl(tmp_path, vision={"num_heads": 1})  # 1 head: weights mode over 2 ranks cannot shard
    with pytest.raises(WorkerError, match=r"worker rank 1 exited with code 3 during startup"):
        _group(str(folder), "weights", _fault={"rank": 1, "at": "start", "action": "exit"})
    assert "num_heads=1 is not divisible by tensor_parallel_size=2" in mmenc_caplog.text
    assert "using mm_encoder_tp_mode='data'" in mmenc_caplog.text


@pytest.mark.slow
def test_interpreter_exit_stops_workers(tiny_model):
    script = textwrap.dedent(f"""
        import torch
        from mmenc.parallel import WorkerGroup
        from mmenc.engine.tower import TowerRecipe
        if __name__ == "__main__":
            g = WorkerGroup(2, TowerRecipe(dict(model={tiny_model[0]!r}, load_format="auto", dtype=torch.float32)),
                            mode="data", device_type="cpu", timeout_s=120)
            print(*g.pids, flush=True)
            # no close(): interpreter exit must stop the workers
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and _all_gone(pids), f"workers {pids} outlived their parent"


def test_staging_chooser_alternates_then_keeps_the_faster():
    from mmenc.parallel.transport import StagingChooser
    chooser = StagingChooser(trials=3, min_bytes=1)
    seen = []
    cost = {"pinned": 5.0, "device": 1.0}  # seconds per call of 1 byte: device is faster here
    for _ in range(6):
        staging = chooser.next()
        seen.append(staging)
        chooser.record(staging, cost[staging], nbytes=1)
    assert seen == ["pinned", "device"] * 3 and chooser.choice == "device"
    assert all(chooser.next() == "device" for _ in range(3))
    chooser.record("pinned", 0.0, 1)  # ignored once chosen
    assert chooser.choice == "device" and len(chooser.samples["pinned"]) == 3
    small = StagingChooser(trials=1, min_bytes=1000)
    small.record("pinned", 1.0, 999)  # too small to say anything about staging
    assert small.samples["pinned"] == [] and small.next() == "pinned"


def test_cuda_transport_rejects_unknown_staging():
    from mmenc.parallel.transport import CudaTransport
    with pytest.raises(ValueError, match=r"staging='fast' is not valid"):
        CudaTransport(2, torch.device("cpu"), staging="fast")


def test_merging_or_splitting_zero_images_is_a_clear_error():
    with pytest.raises(ValueError, match="merge_outputs needs at least one image"):
        merge_outputs([None, None], [[], []], [])
    with pytest.raises(ValueError, match=r"run_data_parallel needs at least one image"):
        run_data_parallel(lambda pv, g: None, torch.zeros(0, 4), torch.zeros(0, 3, dtype=torch.int64), [])


def test_more_cpu_workers_than_cores_warns_then_fails(monkeypatch, mmenc_caplog):
    from mmenc.parallel.workers import check_cpu_workers
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    check_cpu_workers(2, "cpu")
    assert "CPU worker" not in mmenc_caplog.text
    check_cpu_workers(4, "cpu")
    assert "tensor_parallel_size=4 starts 4 CPU worker processes on 2 CPU cores" in mmenc_caplog.text
    with pytest.raises(ValueError, match=r"tensor_parallel_size=64 starts 64 CPU worker processes on 2 CPU cores; "
                                         r"at most 4 .* use tensor_parallel_size <= 2"):
        check_cpu_workers(64, "cpu")
    check_cpu_workers(64, "cuda")  # GPU workers: the device count is checked instead


@pytest.mark.slow
def test_script_without_main_guard_or_on_stdin_gets_one_clear_error(tiny_model, tmp_path):
    """Workers import the main module: a script that starts them at import time, or code on stdin, ends
    with one error saying the fix (not ~130 lines of tracebacks from every worker)."""
    code = textwrap.dedent(f"""
        import torch
        from mmenc import Encoder
        enc = Encoder({tiny_model[0]!r}, device="cpu", dtype="float32", tensor_parallel_size=2,
                      mm_encoder_tp_mode="data", worker_timeout_s=120)
        print("started", flush=True)
    """)
    script = tmp_path / "unguarded.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0 and "started" not in done.stdout
    assert 'RuntimeError: mmenc workers cannot start from this script: put the code that creates the Encoder ' \
           '(or WorkerGroup) under `if __name__ == "__main__":`' in done.stderr, done.stderr[-3000:]
    assert len(done.stderr.splitlines()) < 60, f"{len(done.stderr.splitlines())} lines:\n{done.stderr}"
    done = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode != 0 and "RuntimeError: mmenc workers cannot start: they import the main module, " \
                                    "but it is '<stdin>', not a file" in done.stderr, done.stderr[-3000:]
