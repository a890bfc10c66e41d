"""Fused row kernels (Triton): one pass over each token's row where the reference runs two or three.

    add_norm(x [T, D], delta [T, D], weight [D], bias [D] | None, eps, kind) -> (norm(x + delta), x + delta)
    norm_fp8(x [T, D], weight, bias, eps, kind, width) -> (q fp8e4m3 [T, width], scale float32 [T, 1])
    add_norm_fp8(x, delta, weight, bias, eps, kind, width) -> (q, scale, x + delta)
    act(x [T, 2F] or [T, F], kind, gated, bias=None) -> act(gate) * up [T, F] (gated: x + bias = [gate | up])
        or act(x + bias); bias: the producing linear's, folded in here (its GEMM then runs without one)
    act_fp8(x, kind, gated, width, bias=None) -> (q [T, width], scale [T, 1])

kind: "rms" (RMSNorm, no bias) or "layer" (LayerNorm); activation kinds "silu", "gelu", "gelu_tanh",
"quick_gelu". The FP8 variants quantize the row they produce with a per-token scale (amax / 448, e4m3)
and write `width` >= F columns, the columns past F zero (the padded K an FP8 GEMM needs): the
quantization costs no pass of its own. Rows are any leading shape; the last dim must be contiguous.
Statistics in float32; `x + delta` is rounded to x's dtype before the norm reads it, as the reference
(`x = x + delta; norm(x)`) does. Each row is reduced in one program with a fixed block, so a row's
result depends only on that row (batch invariant).

Every function is a torch custom op (`mmenc::fused_*`) with a fake implementation: torch.compile and
CUDA graphs treat them as opaque kernels. Triton is imported lazily; `available()` says whether it is.
"""
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
NORM_KINDS = ("rms", "layer")
ACT_KINDS = ("silu", "gelu", "gelu_tanh", "quick_gelu")


def available() -> str | None:
    """None when the kernels can run (Triton imports), else why not."""
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"triton is not installed ({e})"
    return None


def _kernels():
    import triton

    from mmenc.backends.kernels import fused_rows_triton as k

    return triton, k.norm_kernel, k.act_kernel


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., D] as [rows, D] with a unit last stride (a view where it can be)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


def _check(kind: str, kinds: tuple[str, ...], what: str) -> int:
    if kind not in kinds:
        raise ValueError(f"{what}={kind!r} is not supported by the fused kernels; expected one of {', '.join(kinds)}")
    return kinds.index(kind)


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8 if block <= 8192 else 16


def _launch_norm(x, delta, weight, bias, eps, kind, width=None):
    triton, norm_kernel, _ = _kernels()
    rms = _check(kind, NORM_KINDS, "norm kind") == 0
    lead, n = x.shape[:-1], x.shape[-1]
    x2 = _rows(x, "x")
    d2 = _rows(delta, "delta") if delta is not None else x2
    quant = width is not None
    y = torch.empty(x2.shape[0], width if quant else n, device=x.device,
                    dtype=torch.float8_e4m3fn if quant else x.dtype)
    scale = torch.empty(x2.shape[0], 1, device=x.device, dtype=torch.float32) if quant else y
    res = torch.empty_like(x2) if delta is not None else x2
    block = triton.next_power_of_2(max(n, width or 0))
    if x2.shape[0]:
        norm_kernel[(x2.shape[0],)](x2, d2, weight, bias if bias is not None else weight, y, scale, res, n,
                                    width or n, x2.stride(0), d2.stride(0), y.stride(0), res.stride(0), eps,
                                    BLOCK=block, RMS=rms, HAS_DELTA=delta is not None, HAS_BIAS=bias is not None,
                                    QUANT=quant, num_warps=_warps(block))
    scale = scale.view(*lead, 1) if quant else None
    return y.view(*lead, y.shape[-1]), scale, res.view(*lead, n)


def _launch_act(x, bias, kind, gated, width=None):
    triton, _, act_kernel = _kernels()
    code = _check(kind, ACT_KINDS, "activation kind")
    lead, n = x.shape[:-1], x.shape[-1] // (2 if gated else 1)
    if gated and x.shape[-1] % 2:
        raise ValueError(f"gated activation input has {x.shape[-1]} features; expected an even number ([gate | up])")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; expected ({x.shape[-1]},), the input's features")
    x2 = _rows(x, "x")
    rows, quant = x2.shape[0], width is not None
    y = torch.empty(rows, width if quant else n, device=x.device, dtype=torch.float8_e4m3fn if quant else x.dtype)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32) if quant else y
    block = triton.next_power_of_2(max(n, width or 0)) if quant else 1024
    grid = (rows,) if quant else (triton.cdiv(rows * n, block),)
    if rows:
        act_kernel[grid](x2, bias if bias is not None else x2, y, scale, rows, n, width or n, x2.stride(0),
                         y.stride(0), BLOCK=block, KIND=code, GATED=gated, HAS_BIAS=bias is not None, QUANT=quant,
                         num_warps=_warps(block))
    return y.view(*lead, y.shape[-1]), scale.view(*lead, 1) if quant else None


def _check_width(width: int, n: int) -> None:
    if width < n:
        raise ValueError(f"width={width} is narrower than the row ({n} features); expected width >= {n}")


@torch.library.custom_op("mmenc::fused_add_norm", mutates_args=())
def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
             kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + delta), x + delta), both [..., D] in x's dtype. See the module docstring."""
    y, _, res = _launch_norm(x, delta, weight, bias, eps, kind)
    return y, res


@add_norm.register_fake
def _(x, delta, weight, bias, eps, kind):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("mmenc::fused_norm_fp8", mutates_args=())
def norm_fp8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, kind: str,
             width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """norm(x) quantized per token: (q float8_e4m3fn [..., width], scale float32 [..., 1])."""
    _check_width(width, x.shape[-1])
    y, scale, _ = _launch_norm(x, None, weight, bias, eps, kind, width)
    return y, scale


@norm_fp8.register_fake
def _(x, weight, bias, eps, kind, width):
    return (x.new_empty(*x.shape[:-1], width, dtype=torch.float8_e4m3fn),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32))


@torch.library.custom_op("mmenc::fused_add_norm_fp8", mutates_args=())
def add_norm_fp8(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                 kind: str, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [..., width], scale [..., 1], x + delta [..., D]): norm(x + delta) quantized per token."""
    _check_width(width, x.shape[-1])
    return _launch_norm(x, delta, weight, bias, eps, kind, width)


@add_norm_fp8.register_fake
def _(x, delta, weight, bias, eps, kind, width):
    return (x.new_empty(*x.shape[:-1], width, dtype=torch.float8_e4m3fn),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32), torch.empty_like(x))


@torch.library.custom_op("mmenc::fused_act", mutates_args=())
def act(x: torch.Tensor, kind: str, gated: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    """act(gate) * up [..., F] from x (+ bias) = [gate | up] [..., 2F] (gated), or act(x + bias) [..., F];
    x's dtype. bias [x's features] or None: the producing linear's bias, added here instead of by its GEMM."""
    return _launch_act(x, bias, kind, gated)[0]


@act.register_fake
def _(x, kind, gated, bias=None):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // (2 if gated else 1))


@torch.library.custom_op("mmenc::fused_act_fp8", mutates_args=())
def act_fp8(x: torch.Tensor, kind: str, gated: bool, width: int,
            bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """act's row quantized per token: (q float8_e4m3fn [..., width], scale float32 [..., 1])."""
    _check_width(width, x.shape[-1] // (2 if gated else 1))
    return _launch_act(x, bias, kind, gated, width)


@act_fp8.register_fake
def _(x, kind, gated, width, bias=None):
    return (x.new_empty(*x.shape[:-1], width, dtype=torch.float8_e4m3fn),
            x.new_empty(*x.shape[:-1], 1, dtype=torch.float32))
