"""The Encoder's surface for tools and the service (launch, graphs, tower-call hooks), and the rule that
nothing outside mmenc/engine reaches past it."""
import pathlib
import re

import pytest
import torch

from mmenc.testing.checkpoints import random_pixels

MMENC = pathlib.Path(__file__).resolve().parents[1] / "mmenc"
GRID = torch.tensor([[1, 8, 8], [1, 4, 8], [2, 4, 4]])  # 64 + 32 + 32 patches


@pytest.fixture(scope="module")
def encoder(reference):
    return reference


def test_launch_is_encode_pixels_without_the_finite_check(encoder):
    pixels = random_pixels(GRID)
    want = encoder.encode_pixels(pixels, GRID, return_extras=True)
    got = encoder.launch(pixels.to(encoder.input_device), GRID)
    assert torch.equal(got.embeddings, want.embeddings)
    assert not encoder.launches_asynchronously  # a CPU tower: launch returns done
    encoder.check_finite(got.embeddings, encoder.output_tokens(GRID))  # finite: no warning, no error


def test_launch_splits_past_max_batch_patches(encoder, monkeypatch):
    pixels = random_pixels(GRID)
    want = encoder.encode_pixels(pixels, GRID)
    calls = []
    monkeypatch.setattr(encoder, "max_batch_patches", 64)
    with encoder.tower_call_hook(lambda run, pv, g: calls.append(g.tolist()) or run(pv, g)):
        got = encoder.launch(pixels, GRID)
    assert calls == [[[1, 8, 8]], [[1, 4, 8], [2, 4, 4]]]
    assert torch.allclose(got.embeddings, want, rtol=1e-5, atol=1e-6)


def test_hooks_nest_and_leave(encoder):
    pixels = random_pixels(GRID)
    order = []

    def named(name):
        def hook(run, pv, g):
            order.append(f"{name} in")
            out = run(pv, g)
            order.append(f"{name} out")
            return out
        return hook

    with encoder.tower_call_hook(named("outer")), encoder.tower_call_hook(named("inner")):
        encoder.encode_pixels(pixels, GRID)
    assert order == ["inner in", "outer in", "outer out", "inner out"]  # the first entered runs closest
    encoder.encode_pixels(pixels, GRID)
    assert len(order) == 4, "a hook outlived its block"


def test_graph_controls_without_graphs(encoder):
    assert encoder.graph_stats() is None and encoder.unreplayed_graphs() == 0 and encoder.graph_recent_calls is None
    encoder.clear_graphs()  # nothing to clear: no error
    with pytest.raises(ValueError, match=r"configure_graphs\(recent_calls=4\): this Encoder has no CUDA graphs"):
        encoder.configure_graphs(recent_calls=4)


def test_graphs_off_runs_the_tower_itself(encoder, monkeypatch):
    pixels = random_pixels(GRID)
    want = encoder.encode_pixels(pixels, GRID)

    class Graphs:  # a stand-in CUDA-graph cache that counts what it is asked
        stats = {"replays": 0}
        recent_calls = 16

        def __call__(self, pv, g):
            self.stats = {"replays": self.stats["replays"] + 1}
            return encoder.loaded.tower(pv, g)

        def unreplayed(self):
            return 0

    graphs = Graphs()
    monkeypatch.setattr(encoder.loaded, "graphs", graphs)
    encoder.encode_pixels(pixels, GRID)
    assert encoder.graph_stats() == {"replays": 1}
    with encoder.graphs_off():
        got = encoder.encode_pixels(pixels, GRID)
    assert encoder.graph_stats() == {"replays": 1} and encoder.loaded.graphs is graphs
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert encoder.graph_recent_calls == 16
    encoder.configure_graphs(recent_calls=None)
    assert graphs.recent_calls is None and encoder.graph_recent_calls is None
    with pytest.raises(ValueError, match=r"recent_calls=0 must be >= 1"):
        encoder.configure_graphs(recent_calls=0)


def test_tower_and_dtype_describe_the_tower_in_this_process(encoder):
    assert encoder.dtype == torch.float32
    assert encoder.tower.config.patch_features == random_pixels(GRID).shape[1]
    assert encoder.tower.output_tokens(GRID) == encoder.output_tokens(GRID)


def test_replace_tower_runs_the_stand_in(q25):
    from mmenc.engine.encoder import Encoder
    from mmenc.models.base import TowerOutput

    seen = []

    class StandIn(torch.nn.Module):  # the replaced tower's token counts, a constant answer
        def __init__(self, replaced):
            super().__init__()
            self.output_tokens = replaced.output_tokens

        def forward(self, pv, g):
            seen.append(pv.dtype)
            return TowerOutput(torch.ones(sum(self.output_tokens(g)), 4, dtype=torch.bfloat16))

    with Encoder(q25, device="cpu") as encoder:
        stand_in = StandIn(encoder.tower)
        encoder.replace_tower(stand_in, dtype=torch.bfloat16)
        got = encoder.encode_pixels(random_pixels(GRID), GRID)
        assert encoder.tower is stand_in and encoder.dtype == torch.bfloat16 and encoder.graph_stats() is None
    assert seen == [torch.bfloat16] and got.shape == (sum(encoder.output_tokens(GRID)), 4)


def test_replace_preprocessor_keeps_the_encoders_choices(q25, tmp_path):
    from PIL import Image

    from mmenc.engine.encoder import Encoder

    path = tmp_path / "a.png"
    Image.new("RGB", (40, 56), (200, 30, 90)).save(path)
    with Encoder(q25, device="cpu", high_bit_depth="scale") as encoder:
        old = encoder.preprocessor
        want = encoder.encode([path])[0]
        encoder.replace_preprocessor(workers=0, decode="cpu")
        new = encoder.preprocessor
        assert new is not old and new.workers == 0 and new.decode == "cpu"
        assert (new.worker_kind, new.resize, new.device) == (old.worker_kind, old.resize, old.device)
        assert new.video is encoder.video_processor and new.work.high_bit_depth == "scale"
        assert torch.equal(encoder.encode([path])[0], want)
    with pytest.raises(AttributeError):
        encoder.loaded = None  # read only: the tower changes through replace_tower


# the Encoder's internals, which only mmenc/engine may touch
REACHES = re.compile(r"\.runner\b|\._executor\b|loaded\.graphs\b|\.graphs\s*=|loaded\.tower\s*=|engine\.executors"
                     r"|getattr\([^)]*[\"']graphs[\"']|\.preprocessor\s*=(?!=)|\.loaded\s*=(?!=)")
BENCHMARKS = MMENC.parent / "benchmarks"


def test_nothing_outside_the_engine_reaches_into_the_encoder():
    files = [p for p in MMENC.rglob("*.py") if "engine" not in p.relative_to(MMENC).parts[:1]]
    found = [f"{path.relative_to(MMENC.parent)}:{number}: {line.strip()}"
             for path in sorted(files + list(BENCHMARKS.rglob("*.py")))
             for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if REACHES.search(line)]
    assert not found, ("code outside mmenc/engine reaches into the Encoder; use its surface (launch, graph_stats, "
                       "graph_recent_calls, configure_graphs, clear_graphs, graphs_off, tower_call_hook, input_device, "
                       "dtype, tower, loaded (read only), replace_tower, replace_preprocessor):\n"
                       + "\n".join(found))
