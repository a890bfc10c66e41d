"""The Triton kernels of mmenc.backends.kernels.fused_rows (imported only when one runs: triton is optional)."""
import triton
import triton.language as tl


@triton.jit
def _activate(x, KIND: tl.constexpr):
    if KIND == 0:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif KIND == 1:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))
    elif KIND == 2:  # gelu_tanh: tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = 0.5 * x * (2.0 / (1.0 + tl.exp(-2.0 * u)))
    else:  # quick_gelu
        y = x / (1.0 + tl.exp(-1.702 * x))
    return y


@triton.jit
def _store_fp8_row(y, mask, cols, width, y_row_ptr, s_row_ptr):
    """The FP8 epilogue of one row y (float32 [BLOCK], `mask` its n valid columns): scale = amax / 448
    (E4M3's largest value) to s_row_ptr; y / scale in the output dtype to the row's first `width`
    columns (zeros past n: the padding the FP8 GEMM reads)."""
    scale = tl.maximum(tl.max(tl.abs(tl.where(mask, y, 0.0)), axis=0), 1e-12) / 448.0
    q = tl.where(mask, y / scale, 0.0)
    tl.store(y_row_ptr + cols, q.to(y_row_ptr.dtype.element_ty), mask=cols < width)
    tl.store(s_row_ptr, scale)


@triton.jit
def norm_kernel(x_ptr, d_ptr, w_ptr, b_ptr, y_ptr, s_ptr, res_ptr, n, width, x_stride, d_stride, y_stride,
                res_stride, eps, BLOCK: tl.constexpr, RMS: tl.constexpr, HAS_DELTA: tl.constexpr,
                HAS_BIAS: tl.constexpr, QUANT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if HAS_DELTA:  # the sum rounded to x's dtype, as the reference's `x = x + delta`, then read back
        total = x.to(tl.float32) + tl.load(d_ptr + row * d_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = total.to(x_ptr.dtype.element_ty)
        tl.store(res_ptr + row * res_stride + cols, x, mask=mask)
    xf = x.to(tl.float32)
    if RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        y = xf * rstd
    else:
        mean = tl.sum(xf, axis=0) / n
        centred = tl.where(mask, xf - mean, 0.0)
        y = centred / tl.sqrt(tl.sum(centred * centred, axis=0) / n + eps)
    y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        _store_fp8_row(y, mask, cols, width, y_ptr + row * y_stride, s_ptr + row)
    else:
        tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def act_kernel(x_ptr, b_ptr, y_ptr, s_ptr, rows, n, width, x_stride, y_stride, BLOCK: tl.constexpr,
               KIND: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr, QUANT: tl.constexpr):
    if QUANT:  # one program per row (its amax), BLOCK >= width
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
    else:  # BLOCK elements of the flattened [rows, n] output per program: no partial block per row
        idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = idx < rows * n
        row = idx // n
        cols = idx % n
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        gate = gate + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _activate(gate, KIND)
    if GATED:
        up = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            up = up + tl.load(b_ptr + n + cols, mask=mask, other=0.0).to(tl.float32)
        y = y * up
    if QUANT:
        _store_fp8_row(y, mask, cols, width, y_ptr + row * y_stride, s_ptr + row)
    else:
        tl.store(y_ptr + row * y_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
