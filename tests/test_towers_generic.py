"""Every registered tower family through the same checks, so a new tower is tested by adding it here:
output shape and finiteness, batch composition and order independence, and data-parallel mode (2 gloo
workers) equal to one process. Parity with transformers lives in each family's own test file."""
import functools

import pytest
import torch

import checkpoints as ck
from mmenc.engine.runner import build_tower, run_tower
from mmenc.models.registry import supported_architectures

# architecture -> (saver, patch features); each saver writes a tiny transformers checkpoint
SAVERS = {
    "Qwen2VLForConditionalGeneration": (ck.save_qwen2_vl, 1176),
    "Qwen2_5_VLForConditionalGeneration": (ck.save_qwen2_5_vl, 1176),
    "Qwen3VLForConditionalGeneration": (ck.save_qwen3_vl, 1536),
    "Qwen3VLMoeForConditionalGeneration": (functools.partial(ck.save_qwen3_vl, moe=True), 1536),
    "Glm4vForConditionalGeneration": (ck.save_glm4v, 1176),
    "Glm4vMoeForConditionalGeneration": (functools.partial(ck.save_glm4v, moe=True), 1176),
    "Kimi_K25ForConditionalGeneration": (ck.save_kimi_k25, 588),
}
# Same tower as a family above under another architecture name; transformers cannot write these.
ALIASES = {"KimiK25ForConditionalGeneration": "Kimi_K25ForConditionalGeneration",
           "KimiVLForConditionalGeneration": "Kimi_K25ForConditionalGeneration"}
GRID = torch.tensor([[1, 8, 12], [1, 4, 4], [1, 6, 2]])


def test_every_registered_architecture_is_covered():
    missing = set(supported_architectures()) - set(SAVERS) - set(ALIASES)
    assert not missing, f"add a saver for {sorted(missing)} to SAVERS (or ALIASES) in this file"


@pytest.fixture(scope="module", params=sorted(SAVERS))
def family(request, tmp_path_factory):
    saver, features = SAVERS[request.param]
    try:
        folder, _ = saver(tmp_path_factory.mktemp(request.param))
    except ImportError as e:
        pytest.skip(f"transformers lacks {request.param}: {e}")
    loaded = build_tower(str(folder), device="cpu")
    pixels = ck.random_pixels(GRID, features, seed=3)
    return request.param, str(folder), loaded, pixels, run_tower(loaded, pixels, GRID)


def test_shapes_and_finite(family):
    arch, _, loaded, _, out = family
    tokens = loaded.output_tokens(GRID)
    assert out.embeddings.shape[0] == sum(tokens), f"{arch}: {out.embeddings.shape[0]} rows, expected {sum(tokens)}"
    assert torch.isfinite(out.embeddings).all(), f"{arch}: non-finite embeddings"


def test_batch_composition_and_order(family):
    arch, _, loaded, pixels, out = family
    tokens = loaded.output_tokens(GRID)
    rows = GRID.prod(-1).tolist()
    per_image_pixels = pixels.split(rows)
    expected = out.embeddings.split(tokens)
    order = [2, 0, 1]
    shuffled = run_tower(loaded, torch.cat([per_image_pixels[i] for i in order]), GRID[order]).embeddings
    for pos, i in enumerate(order):
        got = shuffled.split([tokens[j] for j in order])[pos]
        alone = run_tower(loaded, per_image_pixels[i], GRID[i:i + 1]).embeddings
        for what, value in (("reordered batch", got), ("image alone", alone)):
            err = float((value - expected[i]).norm() / expected[i].norm())
            assert err < 1e-5, f"{arch}: image {i} in a {what} differs by {err:.2e} (tolerance 1e-5)"


@pytest.mark.slow
def test_data_mode_equals_one_process(family):
    from mmenc.engine.workers import WorkerGroup

    arch, folder, _, pixels, out = family
    with WorkerGroup(2, dict(model=folder, load_format="auto", dtype=torch.float32), mode="data",
                     device_type="cpu", timeout_s=120) as group:
        got = group.run(pixels, GRID)
    err = float((got.embeddings - out.embeddings).norm() / out.embeddings.norm())
    assert err < 1e-5, f"{arch}: data mode differs from one process by {err:.2e} (tolerance 1e-5)"
    for key, value in out.extras.items():
        for a, b in zip(got.extras[key], value):
            assert torch.allclose(a, b, atol=1e-5), f"{arch}: data-mode extras[{key!r}] differ"
