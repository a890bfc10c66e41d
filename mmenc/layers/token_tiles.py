"""Batch-invariant matmuls: y = x W^T + b computed over fixed-size token tiles.

GEMM libraries (cuBLAS/cuBLASLt, oneDNN/MKL) choose the kernel (tile sizes, split-K, stream-K)
from the problem's shape, and M is the number of tokens in the call, so a token's output row can
change with what else is in the batch. Here every GEMM call has the same shape [TOKEN_TILE, in]:
the rows are cut into tiles of `tile` tokens and the last tile is padded with zeros to the full
size. A row's result then depends only on its own values (and, for a kernel whose reduction order
differed between row positions of one fixed shape, on its position in the tile: the GPU test
`tests/test_batch_invariance.py::test_gpu_tile_gemm_row_position` checks that it does not).

    tiled_linear(x [..., in], weight [out, in], bias [out] | None, tile) -> [..., out]

It is a torch custom op (`mmenc::tiled_linear`), opaque to torch.compile, so compiled blocks run
exactly the GEMMs eager runs (no Inductor-chosen matmul templates) and CUDA graphs capture the loop.
Rows whose size in bytes is not a multiple of ALIGN_K_BYTES (Qwen2.5-VL's 3420-wide MLP: 6840 bytes)
are zero-padded to it, in both operands (zeros add nothing: every sum is the same): cuBLAS served
such rows with slow kernels (about 200 TFLOP/s instead of 600+ on an H200), and outside this op
torch.compile pads them itself (Inductor's mm padding), which it cannot do through an opaque op.
Cost: up to tile - 1 padded rows per call and one launch per tile (see docs/attention.md).
"""
import torch
import torch.nn.functional as F

# Tokens per GEMM call in batch-invariant mode. Changing it changes the (still invariant) results.
TOKEN_TILE = 4096
# Linears with fewer output features than NARROW_OUT_FEATURES use tiles of NARROW_TOKEN_TILE tokens on
# GPUs (mmenc.layers.linear_kernels.use_token_tiles): a 4096 x 1280 output is only ~160 blocks of 128 x 256,
# 1.2 waves on a 132-SM GPU; such GEMMs took 10-85% more time per row in 4096-row tiles than in 8192-
# or 16384-row ones (H200, bf16, Qwen2.5-VL-7B's 1280-wide linears, benchmarks/invariant_cost.py).
# 8192 rather than 16384: a small call pads those GEMMs to 8192 rows, not 16384.
NARROW_OUT_FEATURES = 2048
NARROW_TOKEN_TILE = 8192
# Input rows are zero-padded to a multiple of this many bytes (0: never).
ALIGN_K_BYTES = 16
# `tile` value that runs mmenc.layers.invariant_gemm's Triton GEMM instead (fixed blocking, any row
# count, no padding, one launch per call; needs triton and a GPU). Opt-in: use_token_tiles(m, TRITON_GEMM).
TRITON_GEMM = 0


@torch.library.custom_op("mmenc::tiled_linear", mutates_args=())
def tiled_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile: int) -> torch.Tensor:
    if tile < 0:
        raise ValueError(f"tile={tile} must be a positive number of tokens (or TRITON_GEMM = 0)")
    rows = x.reshape(-1, x.shape[-1])  # [T, in]
    if tile == TRITON_GEMM:
        from mmenc.layers.invariant_gemm import invariant_linear

        return invariant_linear(rows.contiguous(), weight, bias).reshape(*x.shape[:-1], weight.shape[0])
    pad = -rows.shape[1] % (ALIGN_K_BYTES // rows.element_size()) if ALIGN_K_BYTES >= rows.element_size() else 0
    if pad:  # [T, in + pad] and [out, in + pad], fresh (aligned) buffers whatever x's strides
        rows, weight = F.pad(rows, (0, pad)), F.pad(weight, (0, pad))
    else:
        rows = rows.contiguous()
    if rows.data_ptr() % 256:  # a view at an odd offset (e.g. a chunk of pixel_values): GEMM libraries may pick
        rows = rows.clone()  # their code path from the address, so every tile starts 256-byte aligned
    t, n_out = rows.shape[0], weight.shape[0]
    out = rows.new_empty(t, n_out)
    full = t - t % tile
    for start in range(0, full, tile):
        _gemm(rows[start:start + tile], weight, bias, out[start:start + tile])
    if full < t:  # the last tile, zero-padded to the full size
        padded = rows.new_zeros(tile, rows.shape[1])
        padded[:t - full] = rows[full:]
        res = rows.new_empty(tile, n_out)
        _gemm(padded, weight, bias, res)
        out[full:] = res[:t - full]
    return out.reshape(*x.shape[:-1], n_out)


def _gemm(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out [tile, out] = a [tile, in] @ weight.T (+ bias): the one call every tile makes."""
    if bias is None:
        torch.mm(a, weight.t(), out=out)
    else:
        torch.addmm(bias, a, weight.t(), out=out)


@tiled_linear.register_fake
def _(x, weight, bias, tile):
    return x.new_empty(*x.shape[:-1], weight.shape[0])
