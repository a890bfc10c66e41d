"""On two or more CUDA GPUs: WorkerGroup (NCCL workers; inputs and outputs by CUDA IPC) and the
Encoder with tensor_parallel_size=2 against one GPU in the same process, fp32, for a mixed batch, in
data and weights mode; repeated calls (the IPC buffers are released and reused), a call with fewer
images than ranks, Qwen3-VL's deepstack extras (a list of tensors) travelling back, results on cuda:0."""
import pytest
import torch

from mmenc.engine.tower import build_tower, run_tower
from mmenc.models.base import TowerOutput
from mmenc.testing import checkpoints as ck

pytestmark = pytest.mark.multigpu
TOL = 1e-5
GRID = torch.tensor([[1, 16, 16], [2, 8, 8], [1, 4, 4], [1, 12, 8], [1, 8, 8]])


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _same(got: TowerOutput, want: TowerOutput, what: str) -> None:
    assert got.embeddings.device == torch.device("cuda", 0), f"{what}: result on {got.embeddings.device}"
    err = _err(got.embeddings, want.embeddings)
    assert err < TOL, f"{what}: embeddings relative error {err:.2e}"
    for i, (g, w) in enumerate(zip(got.extras.get("deepstack", []), want.extras.get("deepstack", []), strict=True)):
        assert g.device == torch.device("cuda", 0)
        err = _err(g, w)
        assert err < TOL, f"{what}: deepstack[{i}] relative error {err:.2e}"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tiny(request, tmp_path_factory):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    saver, features = {"qwen2_5_vl": (ck.save_qwen2_5_vl, 1176), "qwen3_vl": (ck.save_qwen3_vl, 1536)}[request.param]
    folder, _ = saver(tmp_path_factory.mktemp(request.param))
    pixels = ck.random_pixels(GRID, features, seed=3)
    loaded = build_tower(model=str(folder), dtype=torch.float32, device="cuda:0")
    want = run_tower(loaded, pixels, GRID)
    del loaded
    return request.param, str(folder), pixels, want


@pytest.mark.parametrize("mode,staging", [("data", "pinned"), ("weights", "pinned"), ("data", "device"),
                                          ("data", "auto")])
def test_group_matches_one_gpu(tiny, mode, staging):
    from mmenc.engine.tower import TowerRecipe
    from mmenc.parallel import WorkerGroup

    name, folder, pixels, want = tiny
    with WorkerGroup(2, TowerRecipe(dict(model=folder, dtype=torch.float32)), mode=mode, device_type="cuda", timeout_s=300,
                     staging=staging) as g:
        assert g.mode == mode
        for call in range(4 if staging == "auto" else 3):  # auto on these small inputs: alternates
            _same(g.run(pixels, GRID), want, f"{name} {mode} call {call}")
        n = int(GRID[0].prod())  # one image: in data mode rank 1 has nothing to do
        one = g.run(pixels[:n], GRID[:1])
        tokens = n // 4
        assert _err(one.embeddings, want.embeddings[:tokens]) < TOL
        _same(g.run(pixels.cuda(1), GRID), want, f"{name} {mode}, input already on cuda:1")
        pids = g.pids
    assert len(pids) == 2


def test_encoder_data_mode_returns_on_cuda0(tiny):
    from mmenc.engine.encoder import Encoder

    name, folder, pixels, want = tiny
    with Encoder(folder, dtype="float32", tensor_parallel_size=2, mm_encoder_tp_mode="data") as enc:
        got = enc.encode_pixels(pixels, GRID, return_extras=True)
    _same(got, want, f"{name} Encoder data mode")
