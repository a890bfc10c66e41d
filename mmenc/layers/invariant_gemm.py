"""A batch-invariant GEMM in Triton: y = x W^T + b where a row's result never depends on the row count.

    invariant_linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]  (x's dtype)

GEMM libraries pick their kernel (tiles, split-K, stream-K) from the problem's shape, so
mmenc.layers.token_tiles fixes the shape instead (token tiles, padded). This kernel fixes the
blocking: one launch configuration (CONFIG), no split-K, every output block [BM, BN] accumulated
over K in BK steps from k = 0 upwards, in fp32, then the bias added and rounded once. Each output
element is therefore the same sequence of operations on the same values whatever T is and
wherever its row sits (rows past T are masked, never mixed in), so there is no padding and one
launch per linear. The row count is not specialised on (do_not_specialize), so every T runs the
same compiled kernel. Opt-in: `use_token_tiles(module, TRITON_GEMM)`; needs triton and a GPU (or
Triton's CPU interpreter).
"""
import dataclasses

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # calling invariant_linear explains what is missing
    triton = None


@dataclasses.dataclass(frozen=True)
class GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3


# Changing it changes the (still invariant) results.
CONFIG = GemmConfig()


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     config: GemmConfig = CONFIG) -> torch.Tensor:
    """x [T, in] (any row stride, unit column stride) -> x W^T + b [T, out]; see the module docstring."""
    if triton is None:
        raise RuntimeError("the Triton batch-invariant GEMM needs the triton package (pip install triton); "
                           "use token tiles (use_token_tiles(module, TOKEN_TILE)) instead")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)}: expected x [T, in] and "
                         f"weight [out, in]")
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    t, k = x.shape
    n = weight.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    grid = (triton.cdiv(t, config.block_m) * triton.cdiv(n, config.block_n),)
    _gemm_kernel[grid](x, weight, bias if bias is not None else weight, out, t, n, k,
                       x.stride(0), weight.stride(0), out.stride(0), HAS_BIAS=bias is not None,
                       BM=config.block_m, BN=config.block_n, BK=config.block_k, GROUP_M=config.group_m,
                       num_warps=config.num_warps, num_stages=config.num_stages)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gemm_kernel(A, W, BIAS, C, M, N, K, stride_am, stride_wn, stride_cm, HAS_BIAS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        """C [M, N] = A [M, K] @ W[N, K]^T (+ BIAS [N]); programs ordered in GROUP_M-row bands (L2 reuse)."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP_M * num_n
        first_m = (pid // per_group) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok = rm < M
        n_ok = rn < N
        a_ptr = A + rm.to(tl.int64)[:, None] * stride_am + rk[None, :]
        w_ptr = W + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            k_ok = rk < K - k0
            a = tl.load(a_ptr, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptr, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc)
            a_ptr += BK
            w_ptr += BK
        if HAS_BIAS:
            acc += tl.load(BIAS + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c_ptr = C + rm.to(tl.int64)[:, None] * stride_cm + rn[None, :]
        tl.store(c_ptr, acc.to(C.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
