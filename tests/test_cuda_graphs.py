"""CUDA graphs per packing (mmenc.engine.cuda_graphs): on CPU, the option's errors and config; on a
GPU, replayed results equal the plain tower's for repeated packings, for two packings with the same
token count split differently (each has its own graph), eager and compiled, and outputs stay valid
after other graphs replay."""
import dataclasses

import pytest
import torch

from mmenc.config import MultiModalConfig
from mmenc.engine.tower import build_tower, run_tower
from mmenc.testing import checkpoints as ck


def test_cuda_graphs_needs_cuda():
    from mmenc.engine.cuda_graphs import CudaGraphCache
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device; the tower is on cpu"):
        CudaGraphCache(torch.nn.Identity(), "cpu")
    with pytest.raises(ValueError, match=r"cuda_graphs=1 must be True or False"):
        MultiModalConfig(cuda_graphs=1)
    assert MultiModalConfig(cuda_graphs=True).compute_hash() != MultiModalConfig().compute_hash()


def test_build_tower_with_cuda_graphs_on_cpu_is_an_error(tmp_path):
    folder, _ = ck.save_qwen2_5_vl(tmp_path)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_tower(model=str(folder), device="cpu", multimodal_config=MultiModalConfig(cuda_graphs=True))


def test_key_is_the_whole_packing():
    from mmenc.engine.cuda_graphs import CudaGraphCache
    cache = CudaGraphCache.__new__(CudaGraphCache)
    pv = torch.zeros(80, 12)
    a = cache.key(pv, torch.tensor([[1, 8, 8], [1, 4, 4]]))
    b = cache.key(pv, torch.tensor([[1, 4, 4], [1, 8, 8]]))  # same tokens, other split
    assert a != b and a == cache.key(pv, torch.tensor([[1, 8, 8], [1, 4, 4]]))


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True])
def test_graph_replays_match_plain_tower(tmp_path, compile):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    folder, _ = ck.save_qwen2_5_vl(tmp_path, vision=dict(hidden_size=160, num_heads=2, intermediate_size=256,
                                                         window_size=112))
    plain = build_tower(model=str(folder), dtype=torch.bfloat16, device="cuda")
    graphed = build_tower(model=str(folder), dtype=torch.bfloat16, device="cuda",
                          multimodal_config=MultiModalConfig(compile=compile, cuda_graphs=True))
    grids = [torch.tensor([[1, 16, 16], [1, 8, 8]]), torch.tensor([[1, 8, 8], [1, 16, 16]]),  # same 320 tokens
             torch.tensor([[1, 12, 8], [2, 4, 8]])]
    pixels = [ck.random_pixels(g, seed=i) for i, g in enumerate(grids)]
    kept = []
    for call in range(4):
        for g, pv in zip(grids, pixels):
            want = run_tower(plain, pv, g).embeddings
            got = run_tower(graphed, pv, g).embeddings
            kept.append((got, want))
            err = ((got.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 1e-2, f"call {call}, grid {g.tolist()}: relative error {err:.2e} vs the plain tower"
    for got, want in kept:  # outputs are copies: later replays did not overwrite them
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
    stats = graphed.graphs.stats
    assert stats["captures"] == 3 and stats["replays"] == 3 * 2 and stats["eager"] == 3, dict(stats)




@pytest.mark.gpu
@pytest.mark.parametrize("arch", sorted(ck.FAMILIES))
def test_families_capture_and_replay(tmp_path, arch):
    """Every packing (ck.FamilyCase.compile_grids) of every family is captured (no host sync or allocation in its forward makes
    the capture fail and fall back to eager) and its replays equal the plain tower."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    case = ck.FAMILIES[arch]
    try:
        folder, _ = case.save(tmp_path / "ckpt")
    except ImportError as e:
        pytest.skip(f"transformers lacks {arch}: {e}")
    plain = build_tower(model=str(folder), dtype=torch.bfloat16, device="cuda")
    graphed = build_tower(model=str(folder), dtype=torch.bfloat16, device="cuda",
                          multimodal_config=MultiModalConfig(cuda_graphs=True))
    grids = [torch.tensor(g) for g in case.grids_to_compile]
    pixels = [case.pixels(g, seed=i).to("cuda", torch.bfloat16) for i, g in enumerate(grids)]
    for call in range(3):
        for g, pv in zip(grids, pixels):
            want = run_tower(plain, pv, g).embeddings.float()
            got = run_tower(graphed, pv, g).embeddings.float()
            err = ((got - want).norm() / want.norm()).item()
            assert err < 1e-2, f"{arch}, call {call}, grid {g.tolist()}: relative error {err:.2e} vs the plain tower"
    stats = graphed.graphs.stats
    assert stats["captures"] == len(grids) and stats["replays"] == len(grids), (
        f"{arch}: {dict(stats)}; expected {len(grids)} captures (a failed capture is logged with its reason)")


def test_graphed_peak_adds_the_graph_pool(monkeypatch):
    """A replay allocates nothing: a graphed row's peak is max_memory_allocated plus the free bytes of
    the private (graph) pools on its device; the default pool and other devices do not count."""
    from mmenc.bench import measure as m

    segments = [dict(device=0, total_size=10 << 30, allocated_size=4 << 30, segment_pool_id=(0, 0)),
                dict(device=0, total_size=3 << 30, allocated_size=1 << 30, segment_pool_id=(1, 7)),
                dict(device=1, total_size=5 << 30, allocated_size=0, segment_pool_id=(1, 9))]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)
    assert m.graph_pool_free_bytes(torch.device("cuda:0")) == 2 << 30
    row = m.BenchRow("w", "mmenc compiled +graphs (TORCH_SDPA)", 1, 1, 1.0, 5.0, 0.0, graph_pool_gib=2.0)
    assert m.call_peak_gib(row) == 7.0
    assert m.call_peak_gib(dataclasses.replace(row, impl="transformers (sdpa)")) == 5.0


@pytest.mark.gpu
def test_graph_pool_is_measured(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mmenc.bench.measure import graph_pool_free_bytes

    folder, _ = ck.save_qwen2_5_vl(tmp_path)
    graphed = build_tower(model=str(folder), dtype=torch.bfloat16, device="cuda",
                          multimodal_config=MultiModalConfig(cuda_graphs=True))
    grid = torch.tensor([[1, 16, 16]])
    pixels = ck.random_pixels(grid)
    for _ in range(3):
        run_tower(graphed, pixels, grid)
    assert graphed.graphs.stats["captures"] == 1
    assert graph_pool_free_bytes(torch.device("cuda")) > 0


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on the CPU: replay() reruns the function it was 'captured' from."""

    def __init__(self, replay):
        self.replay = replay


def _fake_graph_cache(monkeypatch, **kwargs):
    """A CudaGraphCache over a CPU tower whose capture is faked (the policy and bookkeeping are real)."""
    from mmenc.engine.cuda_graphs import CudaGraphCache
    from mmenc.models.base import TowerOutput

    forwards = []

    def tower(pixel_values, grid_thw):
        forwards.append(pixel_values.shape[0])
        return TowerOutput(pixel_values * 2)

    cache = CudaGraphCache(tower, "cuda", **kwargs)  # a device name only: nothing runs on CUDA here

    def record(key, static_in, grid_thw):
        static_out = TowerOutput(torch.empty_like(static_in))
        return _FakeGraph(lambda: static_out.embeddings.copy_(static_in * 2)), static_out

    monkeypatch.setattr(cache, "_record", record)
    return cache, forwards


def _call(cache, rows: int, seed: int = 0):
    pv = torch.randn(rows, 4, generator=torch.Generator().manual_seed(seed))
    out = cache(pv, torch.tensor([[1, 1, rows]]))
    assert torch.equal(out.embeddings, pv * 2), "a replay must give the tower's result"
    return out


def test_capture_policy_repeated_calls_capture_on_the_second_sighting(monkeypatch):
    """encode() called again with the same files: each packing comes back within a few calls, so its
    second sighting captures and later ones replay (as before the recency rule)."""
    cache, _ = _fake_graph_cache(monkeypatch)
    for call in range(4):
        for rows in (4, 8, 16, 20):  # one call = four chunks of a growing schedule
            _call(cache, rows, seed=call)
    assert dict(cache.stats) == {"eager": 4, "captures": 4, "replays": 8}, dict(cache.stats)
    assert cache.unreplayed() == 0


def test_a_packing_whose_plan_was_evicted_runs_eager_before_its_capture(monkeypatch):
    """A capture must not build the plan's host-copied tables: when the tower no longer holds the plan
    of a packing seen before, that call runs eager (rebuilding it) and the next sighting captures."""
    cache, forwards = _fake_graph_cache(monkeypatch)
    cached: set[int] = set()
    cache.tower.has_plan = lambda pv_grid, device: int(pv_grid[0, 2]) in cached
    _call(cache, 4)                 # first sighting: eager
    _call(cache, 4)                 # second: the plan was evicted meanwhile -> eager again
    assert dict(cache.stats) == {"eager": 2, "replanned": 1} and forwards == [4, 4]
    cached.add(4)
    _call(cache, 4)                 # plan cached: captures
    _call(cache, 4)
    assert cache.stats["captures"] == 1 and cache.stats["replays"] == 1


def test_clear_drops_graphs_and_sightings_so_packings_start_over(monkeypatch):
    """`mmenc bench` clears the cache between workloads: after clear() a packing seen and captured
    before runs eagerly once more, then is captured again into a new pool."""
    cache, forwards = _fake_graph_cache(monkeypatch)
    cache._pool = "pool of the first workload"  # what _record would have made
    for seed in range(3):
        _call(cache, 8, seed=seed)
    assert dict(cache.stats) == {"eager": 1, "captures": 1, "replays": 1}, dict(cache.stats)
    cache.clear()
    assert cache._pool is None and not cache._graphs
    for seed in range(3):
        _call(cache, 8, seed=seed)
    assert dict(cache.stats) == {"eager": 2, "captures": 2, "replays": 2}, dict(cache.stats)
    assert forwards == [8, 8]  # the two eager sightings; captures and replays run the (fake) graph


def test_capture_policy_stream_of_mixed_packings_does_not_capture_far_repeats(monkeypatch):
    """A stream whose packings recur only far apart (more than recent_calls calls) never captures: every
    capture there would cost a forward and a synchronisation and never be replayed."""
    cache, _ = _fake_graph_cache(monkeypatch, recent_calls=16)
    for rep in range(3):
        for rows in range(1, 21):  # 20 distinct packings, each back after 20 calls
            _call(cache, rows, seed=rep)
    assert cache.stats["captures"] == 0 and cache.stats["eager"] == 60 and cache.stats["stale"] == 40, dict(cache.stats)
    old, _ = _fake_graph_cache(monkeypatch, recent_calls=None)  # the rule before: 20 captures, no replay
    for rep in range(2):
        for rows in range(1, 21):
            _call(old, rows, seed=rep)
    assert old.stats["captures"] == 20 and old.stats["replays"] == 0 and old.unreplayed() == 20, dict(old.stats)


def test_capture_policy_counts_dropped_graphs_that_never_replayed(monkeypatch):
    cache, _ = _fake_graph_cache(monkeypatch, max_graphs=2)
    for rows in (3, 3, 5, 5, 7, 7):  # three captures, the first dropped for the third; none replayed
        _call(cache, rows)
    assert cache.stats["captures"] == 3 and cache.stats["dropped_unreplayed"] == 1 and cache.unreplayed() == 3
    _call(cache, 7)
    assert cache.stats["replays"] == 1 and cache.unreplayed() == 2
    with pytest.raises(ValueError, match="recent_calls=0 must be >= 1"):
        type(cache)(lambda pv, g: None, "cuda", recent_calls=0)
