"""mmenc's own varlen encoder-attention kernel (Triton): FlashAttention-2-style online softmax.

    varlen_attention(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1],
                     max_seqlen int, scale float) -> out [T, Hq, D] (contiguous, q's dtype)

Non-causal attention confined to each segment of the pack; GQA when Hq % Hkv == 0; fp16/bf16 in,
fp32 accumulation. q/k/v may be strided views as long as stride(-1) == 1.

How the work is cut. One program per (tile, query head). A tile is a run of <= BLOCK_M query rows:
  * a segment longer than BLOCK_M is cut into tiles that each attend to the whole segment;
  * consecutive short segments (<= BLOCK_M) are packed into one tile that attends to the tile's
    own rows, with a block-diagonal mask (per-token segment ids), so 64-token windows fill a
    128-row tile instead of wasting half of it.
The tile table (int32 [tiles, 5]: q_lo, q_hi, kv_lo, kv_hi, number of unmasked KV blocks) and the
per-token segment ids are built on the host from the pack's `PackInfo` (no device read-back) and
cached in `PackInfo.cache`, so every layer of a forward reuses them.

Packs whose segments all fit one block (window attention: 64-token windows) can instead run the
windows kernel (configs with `windows=n`): each window is its own block, n consecutive windows per
program, a single-pass softmax, no segment ids, and the loop lets loads of the next window overlap
this one's math. A windows config on a pack with a longer segment runs the tile kernel.

Head sizes that are not powers of two are split into two power-of-two parts (80 = 64 + 16,
72 = 64 + 16 with 8 masked columns) instead of being padded to 128. Strides are passed with their
alignment (ALIGN): Triton only infers it for multiples of 16, which d=72's head stride is not. On
Hopper, configs with `tma=True` load K/V through TMA tensor descriptors over [T, Hkv, D] (zero fill
past T and past D); elsewhere, or for unaligned strides, they fall back to masked pointer loads.
Configs: `CONFIGS` (mmenc/backends/kernels/triton_attn_plan.py, with the host-side tables) per (length
bucket, head class); the first call per (head size, dtype, GQA group, bucket) times the (two) candidates on its own inputs (not while a CUDA graph is being captured).

torch.compile: `varlen_attention` is the custom op `mmenc::triton_varlen_attn` with a fake
implementation, so compiled towers trace through it without graph breaks. The tile table is not an
argument: the op's real implementation looks the pack up by `cu_seqlens` (see
`mmenc.backends.packing.pack_info`) when it runs, i.e. outside the traced graph. A `cu_seqlens`
made with `make_cu_seqlens` costs nothing; any other tensor is read back once and remembered.
"""
import torch

from mmenc.backends.device import probe_device
from mmenc.backends.packing import PackInfo, make_cu_seqlens, pack_info
from mmenc.backends.kernels.triton_attn_plan import (CONFIGS, KernelConfig, candidates, head_class, head_split,  # noqa: F401
                                            length_bucket, tile_table, window_table)

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # the op still registers; calling it explains what is missing
    triton = None


_CHOSEN: dict[tuple, KernelConfig] = {}
_LOG2E = 1.4426950408889634  # the softmax runs on exp2


def chosen_config(q: torch.Tensor, k: torch.Tensor, max_seqlen: int) -> KernelConfig | None:
    """The config a call on (q, k) of this length bucket has been tuned to (None: not called yet)."""
    return _CHOSEN.get(_choice_key(q, k, max_seqlen))


def _choice_key(q, k, max_seqlen) -> tuple:
    return q.shape[2], q.dtype, q.shape[1] // k.shape[1], length_bucket(max_seqlen)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float) -> torch.Tensor:
    """See the module docstring; the custom op `torch.ops.mmenc.triton_varlen_attn`."""
    return torch.ops.mmenc.triton_varlen_attn(q, k, v, cu_seqlens, int(max_seqlen), float(scale))


@torch.library.custom_op("mmenc::triton_varlen_attn", mutates_args=())
def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
        max_seqlen: int, scale: float) -> torch.Tensor:
    return launch(q, k, v, cu_seqlens, scale)


@_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape)


def checked_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernels' inputs checked (q [T, Hq, D], k and v [T, Hkv, D], Hq % Hkv == 0), each with a unit
    last stride (copied if not), and `out` (a new [T, Hq, D] tensor of q's dtype when None)."""
    if triton is None:
        raise RuntimeError("TRITON_ATTN needs the triton package (pip install triton)")
    num_tokens, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != v.shape or k.shape[0] != num_tokens or k.shape[2] != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [T, Hq, D] "
                         f"and k, v [T, Hkv, D] with Hq % Hkv == 0")
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    return q, k, v, out


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float,
           config: KernelConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Run the kernel eagerly (the op's implementation); `config` skips the tuned choice."""
    q, k, v, out = checked_inputs(q, k, v, out)
    (num_tokens, hq, d), hkv = q.shape, k.shape[1]
    if num_tokens == 0:
        return out
    info = pack_info(cu_seqlens, num_tokens)
    if config is None:
        config = _choose(info, q, k, v, scale)
    da, db = head_split(d, config.split)
    strides = [s for x in (q, k, v, out) for s in x.stride()[:2]]  # (token, head) of each
    common = {"GROUP": hq // hkv, "HEAD_DIM": d, "DA": da, "DB": max(db, 16), "HAS_B": db > 0,
              "ALIGN": _stride_align(q, k, v, out), "num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.windows and info.max_seqlen <= config.block_m:
        bounds = window_table(info, q.device)
        n_windows = bounds.shape[0] - 1
        grid = (triton.cdiv(n_windows, config.windows), hq)
        _windows_kernel[grid](q, k, v, out, bounds, n_windows, scale * _LOG2E, *strides,
                              BLOCK=config.block_m, PER_PROGRAM=config.windows, PAIRS=False, **common)
        return out
    tiles, seg_ids = tile_table(info, config.block_m, config.block_n, q.device)
    descs = (k, k, v, v)
    if config.tma and _tma_ok(q, k, v):
        descs = tuple(TensorDescriptor(x, list(x.shape), list(x.stride()), [config.block_n, 1, part])
                      for x in (k, v) for part in (da, max(db, 16)))
    _kernel[(tiles.shape[0], hq)](q, k, v, out, tiles, seg_ids, *descs, scale * _LOG2E, *strides,
                                  BLOCK_M=config.block_m, BLOCK_N=config.block_n, USE_TMA=descs[0] is not k, **common)
    return out


def _stride_align(*tensors) -> int:
    """The largest power of two (elements, at most 16 bytes' worth) dividing every non-unit stride."""
    align = 16 // tensors[0].element_size()
    while align > 1 and any(s % align for x in tensors for s in x.stride()[:-1]):
        align //= 2
    return align


def _tma_ok(q, k, v) -> bool:
    """TMA (Hopper+) needs 16-byte aligned bases and strides (head size a multiple of 8 in fp16/bf16)."""
    capability = probe_device(q.device).capability if q.is_cuda else None
    if capability is None or capability < (9, 0):
        return False
    return all(x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0 for s in x.stride()[:-1]) for x in (k, v))


def _choose(info: PackInfo, q, k, v, scale) -> KernelConfig:
    """The config for this (head size, dtype, GQA group, length bucket): tuned once on these inputs."""
    key = _choice_key(q, k, info.max_seqlen)
    if key not in _CHOSEN:
        configs = candidates(q.shape[2], info.max_seqlen)
        if len(configs) == 1 or not q.is_cuda or torch.cuda.is_current_stream_capturing():
            return configs[0]
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        cu, _ = make_cu_seqlens(info.lengths, q.device)  # a registered twin: no read-back while tuning
        times = [_time(lambda c=c: launch(q, k, v, cu, scale, c, out)) for c in configs]
        if min(times) == float("inf"):
            raise RuntimeError(f"TRITON_ATTN: no config of {[str(c) for c in configs]} fits this GPU's shared memory "
                               f"for head_size {q.shape[2]}; add a smaller one to CONFIGS[{key[3]!r}, ...]")
        _CHOSEN[key] = configs[min(range(len(times)), key=times.__getitem__)]
    return _CHOSEN[key]


def _time(fn) -> float:
    """Median ms of fn, or inf when its config needs more shared memory than the GPU has."""
    try:
        return triton.testing.do_bench(fn, warmup=5, rep=20)
    except triton.runtime.errors.OutOfResources:
        return float("inf")


if triton is not None:

    @triton.jit
    def _load_kv(ptr, off, desc, start, kv_head, col0, col_ok, dim_ok, FULL: tl.constexpr, MASKED: tl.constexpr,
                 USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, DX: tl.constexpr):
        """A [BN, DX] block of K or V. TMA zero-fills past T and past the head size; keys of other
        segments are masked by the caller."""
        if USE_TMA:
            x = desc.load([start, kv_head, col0]).reshape(BLOCK_N, DX)
        elif FULL and not MASKED:
            x = tl.load(ptr + off)
        elif MASKED:
            x = tl.load(ptr + off, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        else:
            x = tl.load(ptr + off, mask=dim_ok[None, :], other=0.0)
        return x

    @triton.jit
    def _block(acc_a, acc_b, l_i, m_i, q_a, q_b, seg_q, k_base, v_base, seg_ptr, start, kv_hi,
               k_off_a, k_off_b, v_off_a, v_off_b, a_ok, b_ok, offs_n, qk_scale, KA, KB, VA, VB, kv_head,
               A_FULL: tl.constexpr, B_FULL: tl.constexpr, HAS_B: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr, BLOCK_N: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr):
        """One KV block of the online softmax; MASKED applies the segment mask (edge/packed blocks)."""
        cols = start + offs_n  # [BN]
        col_ok = cols < kv_hi
        k_a = _load_kv(k_base, k_off_a, KA, start, kv_head, 0, col_ok, a_ok, A_FULL, MASKED, USE_TMA, BLOCK_N, DA)
        qk = tl.dot(q_a, tl.trans(k_a))  # [BM, BN] fp32
        if HAS_B:
            k_b = _load_kv(k_base, k_off_b, KB, start, kv_head, DA, col_ok, b_ok, B_FULL, MASKED, USE_TMA, BLOCK_N, DB)
            qk = tl.dot(q_b, tl.trans(k_b), qk)
        if MASKED:
            seg_k = tl.load(seg_ptr + cols, mask=col_ok, other=-1)
            qk = tl.where(seg_q[:, None] == seg_k[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_a.dtype)
        v_a = _load_kv(v_base, v_off_a, VA, start, kv_head, 0, col_ok, a_ok, A_FULL, MASKED, USE_TMA, BLOCK_N, DA)
        acc_a = tl.dot(p, v_a, acc_a * alpha[:, None])
        if HAS_B:
            v_b = _load_kv(v_base, v_off_b, VB, start, kv_head, DA, col_ok, b_ok, B_FULL, MASKED, USE_TMA, BLOCK_N, DB)
            acc_b = tl.dot(p, v_b, acc_b * alpha[:, None])
        return acc_a, acc_b, l_i, m_new

    @triton.jit
    def _windows_kernel(Q, K, V, O, BOUNDS, n_windows, qk_scale,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                        HAS_B: tl.constexpr, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr, ALIGN: tl.constexpr,
                        PAIRS: tl.constexpr = False):
        """Packs of short windows (every segment <= BLOCK tokens): one program per (PER_PROGRAM
        consecutive windows, query head). Each window attends to itself in a single block, so the
        softmax is one pass (no running max) and no segment ids are read; the loop over windows lets
        the compiler prefetch the next window while this one computes. BOUNDS: int32 [n_windows + 1]
        (window w is BOUNDS[w]..BOUNDS[w + 1]), or with PAIRS int32 [n_windows, 2] (start, end)."""
        stride_qt, stride_qh = stride_qt // ALIGN * ALIGN, stride_qh // ALIGN * ALIGN  # see _kernel
        stride_kt, stride_kh = stride_kt // ALIGN * ALIGN, stride_kh // ALIGN * ALIGN
        stride_vt, stride_vh = stride_vt // ALIGN * ALIGN, stride_vh // ALIGN * ALIGN
        stride_ot, stride_oh = stride_ot // ALIGN * ALIGN, stride_oh // ALIGN * ALIGN
        head = tl.program_id(1)
        kv_head = head // GROUP
        first = tl.program_id(0) * PER_PROGRAM
        last = tl.minimum(first + PER_PROGRAM, n_windows)
        offs = tl.arange(0, BLOCK)
        offs_a = tl.arange(0, DA)
        offs_b = DA + tl.arange(0, DB)
        a_ok = offs_a < HEAD_DIM
        b_ok = offs_b < HEAD_DIM
        q_head = Q + head * stride_qh + offs[:, None] * stride_qt  # [BLOCK, 1] pointers of row r
        k_head = K + kv_head * stride_kh + offs[:, None] * stride_kt
        v_head = V + kv_head * stride_vh + offs[:, None] * stride_vt
        o_head = O + head * stride_oh + offs[:, None] * stride_ot
        for w in range(first, last):
            if PAIRS:  # BOUNDS [n_windows, 2]: (start, end) of each window, not necessarily adjacent
                lo = tl.load(BOUNDS + 2 * w)
                hi = tl.load(BOUNDS + 2 * w + 1)
            else:
                lo = tl.load(BOUNDS + w)
                hi = tl.load(BOUNDS + w + 1)
            ok = offs < hi - lo  # [BLOCK] rows (and keys) of this window
            lo = lo.to(tl.int64)
            mask_a = ok[:, None] & a_ok[None, :]
            q_a = tl.load(q_head + lo * stride_qt + offs_a[None, :], mask=mask_a, other=0.0)
            k_a = tl.load(k_head + lo * stride_kt + offs_a[None, :], mask=mask_a, other=0.0)
            qk = tl.dot(q_a, tl.trans(k_a))  # [BLOCK, BLOCK] fp32
            if HAS_B:
                mask_b = ok[:, None] & b_ok[None, :]
                q_b = tl.load(q_head + lo * stride_qt + offs_b[None, :], mask=mask_b, other=0.0)
                k_b = tl.load(k_head + lo * stride_kt + offs_b[None, :], mask=mask_b, other=0.0)
                qk = tl.dot(q_b, tl.trans(k_b), qk)
            qk = tl.where(ok[None, :], qk, float("-inf"))  # rows past the window: q = 0, harmless
            p = tl.math.exp2((qk - tl.max(qk, 1)[:, None]) * qk_scale)
            inv_l = 1.0 / tl.sum(p, 1)
            p = p.to(q_a.dtype)
            v_a = tl.load(v_head + lo * stride_vt + offs_a[None, :], mask=mask_a, other=0.0)
            o_a = tl.dot(p, v_a) * inv_l[:, None]
            tl.store(o_head + lo * stride_ot + offs_a[None, :], o_a.to(O.dtype.element_ty), mask=mask_a)
            if HAS_B:
                v_b = tl.load(v_head + lo * stride_vt + offs_b[None, :], mask=mask_b, other=0.0)
                o_b = tl.dot(p, v_b) * inv_l[:, None]
                tl.store(o_head + lo * stride_ot + offs_b[None, :], o_b.to(O.dtype.element_ty), mask=mask_b)

    @triton.jit
    def _kernel(Q, K, V, O, TILES, SEG, KA, KB, VA, VB, qk_scale,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr,
                ALIGN: tl.constexpr):
        """KA/KB/VA/VB: TMA descriptors of K and V ([T, Hkv, D], blocks [BN, 1, DA|DB]) when USE_TMA,
        else unused (the K/V tensors again). ALIGN: a power of two (elements) dividing every stride."""
        # Triton only knows a stride's alignment when it is a multiple of 16 (d=72: stride_h = 72 is
        # not), and without it every Q/K/V/O access is a scalar 2-byte load/store. x // A * A (a shift
        # pair) states the alignment in a way the compiler tracks (tl.multiple_of on an argument is lost).
        stride_qt, stride_qh = stride_qt // ALIGN * ALIGN, stride_qh // ALIGN * ALIGN
        stride_kt, stride_kh = stride_kt // ALIGN * ALIGN, stride_kh // ALIGN * ALIGN
        stride_vt, stride_vh = stride_vt // ALIGN * ALIGN, stride_vh // ALIGN * ALIGN
        stride_ot, stride_oh = stride_ot // ALIGN * ALIGN, stride_oh // ALIGN * ALIGN
        tile = tl.program_id(0)
        head = tl.program_id(1)
        q_lo = tl.load(TILES + tile * 5)
        q_hi = tl.load(TILES + tile * 5 + 1)
        kv_lo = tl.load(TILES + tile * 5 + 2)
        kv_hi = tl.load(TILES + tile * 5 + 3)
        n_full = tl.load(TILES + tile * 5 + 4)
        A_FULL: tl.constexpr = DA <= HEAD_DIM
        B_FULL: tl.constexpr = DA + DB <= HEAD_DIM

        offs_m = tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_a = tl.arange(0, DA)
        offs_b = DA + tl.arange(0, DB)
        a_ok = offs_a < HEAD_DIM
        b_ok = offs_b < HEAD_DIM
        rows = q_lo + offs_m
        row_ok = rows < q_hi

        # Q tile, loaded once: [BM, DA] (+ [BM, DB])
        q_rows = Q + q_lo.to(tl.int64) * stride_qt + head * stride_qh + offs_m[:, None] * stride_qt
        q_a = tl.load(q_rows + offs_a[None, :], mask=row_ok[:, None] & a_ok[None, :], other=0.0)
        if HAS_B:
            q_b = tl.load(q_rows + offs_b[None, :], mask=row_ok[:, None] & b_ok[None, :], other=0.0)
        else:
            q_b = tl.zeros((BLOCK_M, DB), dtype=q_a.dtype)
        seg_q = tl.load(SEG + rows, mask=row_ok, other=-1)

        kv_head = head // GROUP
        k_head = K + kv_head * stride_kh
        v_head = V + kv_head * stride_vh
        k_off_a = offs_n[:, None] * stride_kt + offs_a[None, :]  # [BN, DA]
        k_off_b = offs_n[:, None] * stride_kt + offs_b[None, :]
        v_off_a = offs_n[:, None] * stride_vt + offs_a[None, :]
        v_off_b = offs_n[:, None] * stride_vt + offs_b[None, :]

        m_i = tl.full((BLOCK_M,), -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay NaN-free
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc_a = tl.zeros((BLOCK_M, DA), dtype=tl.float32)
        acc_b = tl.zeros((BLOCK_M, DB), dtype=tl.float32)

        k_ptr = k_head + kv_lo.to(tl.int64) * stride_kt  # advanced by one KV block per iteration
        v_ptr = v_head + kv_lo.to(tl.int64) * stride_vt
        full_end = kv_lo + n_full * BLOCK_N
        for start in range(kv_lo, full_end, BLOCK_N):
            acc_a, acc_b, l_i, m_i = _block(
                acc_a, acc_b, l_i, m_i, q_a, q_b, seg_q, k_ptr, v_ptr, SEG, start, kv_hi,
                k_off_a, k_off_b, v_off_a, v_off_b, a_ok, b_ok, offs_n, qk_scale, KA, KB, VA, VB, kv_head,
                A_FULL, B_FULL, HAS_B, False, USE_TMA, BLOCK_N, DA, DB)
            k_ptr += BLOCK_N * stride_kt
            v_ptr += BLOCK_N * stride_vt
        for start in range(full_end, kv_hi, BLOCK_N):
            acc_a, acc_b, l_i, m_i = _block(
                acc_a, acc_b, l_i, m_i, q_a, q_b, seg_q, k_ptr, v_ptr, SEG, start, kv_hi,
                k_off_a, k_off_b, v_off_a, v_off_b, a_ok, b_ok, offs_n, qk_scale, KA, KB, VA, VB, kv_head,
                A_FULL, B_FULL, HAS_B, True, USE_TMA, BLOCK_N, DA, DB)
            k_ptr += BLOCK_N * stride_kt
            v_ptr += BLOCK_N * stride_vt

        inv_l = 1.0 / tl.where(l_i > 0.0, l_i, 1.0)  # rows past the tile end have l == 0
        o_rows = O + q_lo.to(tl.int64) * stride_ot + head * stride_oh + offs_m[:, None] * stride_ot
        tl.store(o_rows + offs_a[None, :], (acc_a * inv_l[:, None]).to(O.dtype.element_ty),
                 mask=row_ok[:, None] & a_ok[None, :])
        if HAS_B:
            tl.store(o_rows + offs_b[None, :], (acc_b * inv_l[:, None]).to(O.dtype.element_ty),
                     mask=row_ok[:, None] & b_ok[None, :])

