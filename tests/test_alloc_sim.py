"""The CUDA caching-allocator model behind benchmarks/peak_memory_cpu.py (mmenc.bench.alloc_sim): segments
made per unmet request, best-fit reuse with splitting, no merging across segments; traces extrapolated
linearly in the token count; a real forward's trace on the CPU."""
import pytest
import torch

from mmenc.bench.alloc_sim import CachingAllocatorModel, extrapolate, trace

MIB = 1 << 20


def test_reuse_split_and_new_segments():
    model = CachingAllocatorModel().replay([(0, 100 * MIB), (1, 300 * MIB), (0, -100 * MIB), (2, 100 * MIB)])
    assert model.reserved == 400 * MIB, "the freed 100 MiB block serves the next 100 MiB request"
    assert model.peak_live == 400 * MIB
    model.replay([(1, -300 * MIB), (3, 100 * MIB), (4, 200 * MIB)])  # both carved out of the 300 MiB segment
    assert model.reserved == 400 * MIB
    model.replay([(2, -100 * MIB), (3, -100 * MIB), (4, -200 * MIB), (5, 400 * MIB)])
    assert model.reserved == 800 * MIB, "free blocks in different segments do not merge: 400 MiB needs a segment"
    model.replay([(6, 5 * MIB)])  # fits in a free block
    assert model.reserved == 800 * MIB and model.peak_live == 405 * MIB


def test_segment_rounding():
    assert CachingAllocatorModel().replay([(0, 3 * MIB)]).reserved == 20 * MIB  # under 10 MiB: a 20 MiB buffer
    assert CachingAllocatorModel().replay([(0, 11 * MIB + 1)]).reserved == 12 * MIB  # rounded up to 2 MiB
    assert CachingAllocatorModel().replay([(0, 1000)]).reserved == 0  # small pool: not modelled


def test_extrapolate_is_linear_and_checks_the_events():
    small = [(0, 1000), (1, 5000), (0, -1000)]
    large = [(0, 2000), (1, 5000), (0, -2000)]
    assert extrapolate(small, large, 10, 20, 100) == [(0, 10000), (1, 5000), (0, -10000)]
    with pytest.raises(ValueError, match="differ"):
        extrapolate(small, large[:2], 10, 20, 100)


def test_trace_of_a_forward():
    x = torch.randn(256, 1024)  # 1 MiB
    seq, out = trace(lambda: (x * 2).sum(0))
    sizes = [n for _, n in seq]
    assert MIB in sizes and -MIB in sizes, f"the 1 MiB temporary x * 2 and its free: {sizes}"
    assert out.shape == (1024,)


def test_gpu_like_norms_allocate_only_the_output():
    """Under gpu_like_norms an eager rms_norm gives torch's values and allocates only its output (plus
    small-pool chunks), as the GPU's fused kernel; torch's CPU composite makes float32 [rows, hidden]
    temporaries (what the modelled pools used to count). F.rms_norm is restored afterwards."""
    from torch.nn import functional as F

    from mmenc.bench.alloc_sim import SMALL, gpu_like_norms

    original = F.rms_norm
    x, w = torch.randn(4096, 512, dtype=torch.bfloat16), torch.rand(512, dtype=torch.bfloat16)
    want = F.rms_norm(x, (512,), w, 1e-6)
    cpu_seq, _ = trace(lambda: F.rms_norm(x, (512,), w, 1e-6))
    with gpu_like_norms():
        seq, got = trace(lambda: F.rms_norm(x, (512,), w, 1e-6))
    assert F.rms_norm is original
    assert torch.equal(got, want)
    out_bytes = x.numel() * x.element_size()
    large = [n for _, n in seq if n > SMALL]
    assert large == [out_bytes], f"large allocations {large}; expected only the output ({out_bytes} bytes)"
    assert max(n for _, n in cpu_seq) > out_bytes, "torch's CPU rms_norm no longer makes float32 temporaries?"
