"""Blocks and towers with the fused row kernels (mmenc.layers.fused) against the reference path.

Runs the kernels in Triton's interpreter on a machine without CUDA; skipped without triton."""
import os

import pytest
import torch

if not torch.cuda.is_available():  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mmenc.backends.kernels import fused_rows  # noqa: E402  registers the mmenc::fused_* ops the layers call
from mmenc.backends.linear.fp8 import Fp8Linear  # noqa: E402
from mmenc.layers import fused  # noqa: E402
from mmenc.layers.fused import use_fused_kernels  # noqa: E402
from mmenc.layers.linear_kernels import prepare_linears  # noqa: E402
from mmenc.layers.vision_blocks import VisionBlock  # noqa: E402
from mmenc.testing.random_weights import init_comparable_weights_  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def make_block(dtype, **kw):
    block = VisionBlock(64, 4, 96, device=DEVICE, dtype=dtype, **kw).eval()
    init_comparable_weights_(block, std=0.1)
    return block


def run(block, x, cu):
    with torch.inference_mode():
        return block(x, cu, int((cu[1:] - cu[:-1]).max()))


CU = torch.tensor([0, 5, 12, 20], dtype=torch.int32)


def test_the_layer_sends_the_activations_the_kernels_compute():
    assert fused.ACT_KINDS == fused_rows.ACT_KINDS


@pytest.mark.parametrize("kw", [dict(norm="rms", mlp="gated", act="silu"),
                                dict(norm="layer", mlp="plain", act="gelu_pytorch_tanh"),
                                dict(norm="layer", mlp="plain", act="quick_gelu")])
def test_fused_block_matches_reference(kw):
    block = make_block(torch.float32, **kw)
    x = torch.randn(20, 64, device=DEVICE)
    cu = CU.to(DEVICE)
    want = run(block, x, cu)
    assert use_fused_kernels(block) == 2  # the block and its MLP
    got = run(block, x, cu)
    assert rel(got, want) < 1e-5, rel(got, want)
    use_fused_kernels(block, enabled=False)
    assert torch.equal(run(block, x, cu), want)


def test_fused_block_with_layer_scale_and_row_blocks_falls_back_exactly():
    """Layer scale (InternViT) and split MLP rows take the reference residual path, still correct."""
    block = make_block(torch.float32, layer_scale=True)
    block.max_intermediate_bytes = 1024  # forces the row-block split too
    x = torch.randn(20, 64, device=DEVICE)
    want = run(block, x, CU.to(DEVICE))
    use_fused_kernels(block)
    assert rel(run(block, x, CU.to(DEVICE)), want) < 1e-5


def test_fused_fp8_block_quantizes_inside_the_kernels():
    """With FP8 linears, the fused path hands QuantizedRows from the norm / SiLU-gate kernels to the GEMMs;
    it agrees with the unfused FP8 path (quantizing in the backend) to e4m3's rounding."""
    block = make_block(torch.bfloat16, norm="rms", mlp="gated", act="silu")
    x = torch.randn(20, 64, device=DEVICE, dtype=torch.bfloat16)
    cu = CU.to(DEVICE)
    bf16 = run(block, x, cu)
    prepare_linears(block, Fp8Linear)
    unfused = run(block, x, cu)
    calls = []
    original = Fp8Linear.apply_quantized.__func__

    def spy(cls, state, rows, add_bias=True):
        calls.append((rows.data.shape, add_bias))
        return original(cls, state, rows, add_bias)
    Fp8Linear.apply_quantized = classmethod(spy)
    try:
        use_fused_kernels(block)
        fused = run(block, x, cu)
        quantized_by_apply = len(calls)
    finally:
        Fp8Linear.apply_quantized = classmethod(original)
    assert quantized_by_apply == 4  # qkv, gate_up, down (pre-quantized) and proj
    assert [add for _, add in calls] == [True, True, False, True]  # gate_up's bias added by the SiLU-gate kernel
    # Triton's interpreter rounds float32 -> e4m3 worse than the GPU (tests/test_fused_rows.py)
    tol = 0.06 if os.environ.get("TRITON_INTERPRET") == "1" else 0.02
    assert rel(fused, unfused) < tol, rel(fused, unfused)
    assert rel(fused, bf16) < 1.5 * rel(unfused, bf16) + 0.01, (rel(fused, bf16), rel(unfused, bf16))


def test_fused_tower_matches_reference(q25):
    """A whole tower (the tiny Qwen2.5-VL checkpoint) with the fused kernels, float32."""
    from mmenc.engine.tower import build_tower
    from mmenc.testing.checkpoints.base import random_pixels

    loaded = build_tower(q25, device=DEVICE, dtype="float32")
    grid = torch.tensor([[1, 4, 4], [1, 4, 6]])
    pixels = random_pixels(grid, loaded.config.patch_features).to(DEVICE)
    with torch.inference_mode():
        want = loaded.tower(pixels, grid).embeddings
        assert use_fused_kernels(loaded.tower) > 0
        got = loaded.tower(pixels, grid).embeddings
    assert rel(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_block_compiles_into_one_graph():
    """torch.compile(fullgraph=True) over a fused FP8 block: the kernels are opaque custom ops."""
    block = make_block(torch.bfloat16, norm="rms", mlp="gated", act="silu")
    prepare_linears(block, Fp8Linear)
    use_fused_kernels(block)
    x = torch.randn(20, 64, device="cuda", dtype=torch.bfloat16)
    cu = CU.cuda()
    eager = run(block, x, cu)
    compiled = torch.compile(block, fullgraph=True, dynamic=True)
    with torch.inference_mode():
        got = compiled(x, cu, 8)
    assert rel(got, eager) < 1e-2
