"""Regional compilation: every family's blocks trace in one graph (fullgraph, no break around the
attention custom op), one compiled graph serves every block and new image sizes, and the output is
unchanged. Dynamo only (backend "eager") to stay fast on CPU; the GPU parity test runs inductor."""
import pytest
import torch
import torch._dynamo

from mmenc.config import MultiModalConfig
from mmenc.engine.compile import compile_tower
from mmenc.engine.tower import build_tower, run_tower
from mmenc.testing import checkpoints as ck

@pytest.mark.parametrize("arch", sorted(ck.FAMILIES))
def test_blocks_compile_fullgraph(arch, tmp_path):
    """Every family of the family table on its (mixed, dense) compile grids (ck.FamilyCase.compile_grids)."""
    case = ck.FAMILIES[arch]
    try:
        folder, _ = case.save(tmp_path / "ckpt")
    except ImportError as e:
        pytest.skip(f"transformers lacks {arch}: {e}")
    loaded = build_tower(str(folder), device="cpu")
    grids = [torch.tensor(g) for g in case.grids_to_compile]
    pixels = [case.pixels(g, seed=i) for i, g in enumerate(grids)]
    want = [run_tower(loaded, p, g).embeddings for p, g in zip(pixels, grids)]
    torch._dynamo.reset()
    n = compile_tower(loaded.tower, MultiModalConfig(compile=True), backend="eager", fullgraph=True)
    depth = sum(1 for name, _ in loaded.tower.named_modules() if name.rsplit(".", 2)[-2:-1] == ["blocks"])
    assert n > 0, (f"{arch}: no block of {type(loaded.tower).__name__} was compiled (compile_tower finds "
                   f"VisionBlocks and modules named blocks.N)")
    assert depth in (0, n), f"{arch}: compiled {n} of {depth} blocks"
    torch._dynamo.utils.counters.clear()
    for p, g, w in zip(pixels, grids, want):
        got = run_tower(loaded, p, g).embeddings
        assert torch.allclose(got, w, rtol=1e-5, atol=1e-6), f"{arch}: compiled output differs on grid {g.tolist()}"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs <= 2, f"{arch}: {graphs} graphs for one block class over two image sizes (expected <= 2)"


def test_compiling_raises_the_recompile_limit_and_never_lowers_it(monkeypatch):
    """One block class serves every tower of its families, so a process compiling several towers passes
    dynamo's default limit of 8 recompilations (a hard error with fullgraph=True; 9 GPU parity rows in one
    test process, run 9c): compiled_forward raises the limit to RECOMPILE_LIMIT, never lowers it."""
    from mmenc.engine import compile as mmenc_compile
    from mmenc.layers.vision_blocks import VisionBlock

    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    monkeypatch.setattr(mmenc_compile, "_COMPILED", {})
    before = getattr(config, name)  # restored by hand: monkeypatch's undo on torch's config module hides the key
    try:
        setattr(config, name, 8)
        mmenc_compile.compiled_forward(VisionBlock, MultiModalConfig(compile=True), backend="eager")
        assert getattr(config, name) == mmenc_compile.RECOMPILE_LIMIT
        setattr(config, name, 500)
        mmenc_compile.compiled_forward(VisionBlock, MultiModalConfig(compile=True, cuda_graphs=False),
                                       backend="aot_eager")
        assert getattr(config, name) == 500
    finally:
        setattr(config, name, before)
