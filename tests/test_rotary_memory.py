"""apply_rotary (mmenc.layers.rotary) multiplies its float32 copies in place: the same bits as the plain
formula x*cos + rotate(x)*sin (eager, both layouts, every float dtype), its input untouched (also a float32
view of a larger qkv tensor), and fewer float32 copies alive at once (what set GLM-OCR's eager peak)."""
import pytest
import torch

from mmenc.bench.alloc_sim import CachingAllocatorModel, trace
from mmenc.layers.rotary import _rotate, apply_rotary


def _formula(x, cos, sin, interleaved):
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    xf = x.float()
    return (xf * cos.view(shape) + _rotate(xf, interleaved) * sin.view(shape)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
def test_in_place_rotation_is_bitwise_the_formula(dtype, interleaved):
    torch.manual_seed(0)
    qkv = torch.randn(301, 3, 4, 18).to(dtype)
    qk = qkv[:, :2]  # a view, as VisionAttention passes it
    before = qkv.clone()
    cos, sin = torch.randn(301, 18), torch.randn(301, 18)
    got = apply_rotary(qk, cos, sin, interleaved)
    assert torch.equal(got, _formula(qk, cos, sin, interleaved))
    assert torch.equal(qkv, before), "apply_rotary changed its input"
    assert got.dtype == dtype and got.shape == qk.shape


def test_fewer_float32_copies_alive():
    x = torch.randn(4096, 2, 4, 64, dtype=torch.bfloat16)  # 4 MiB in bf16, 8 MiB per float32 copy
    cos, sin = torch.randn(4096, 64), torch.randn(4096, 64)
    new, _ = trace(lambda: apply_rotary(x, cos, sin))
    old, _ = trace(lambda: _formula(x, cos, sin, False))
    peak_new, peak_old = CachingAllocatorModel().replay(new).peak_live, CachingAllocatorModel().replay(old).peak_live
    copy = x.numel() * 4
    print(f"apply_rotary live peak {peak_new / copy:.2f} float32 copies of x (the formula: {peak_old / copy:.2f})")
    assert peak_new <= 2.6 * copy < peak_old
