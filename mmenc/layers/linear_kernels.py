"""Tower-wide settings of the parallel linears (mmenc.layers.linear): the kernel each runs on, token
tiles, and what they hold.

Kernel backends: `prepare_linears(module, backend)` hands every linear's weight (and the bias its
matmul adds) to a linear backend once after loading (mmenc.backends.linear: NATIVE keeps it as is,
ONEDNN packs it for oneDNN, replacing the loaded tensor); forward then calls the backend.
`restore_linears(module)` gives plain weights back (VisionTower.load_weights does it before loading);
`linear_plan` / `prepare_plan` record and apply again which backend each linear runs on.

Batch invariance: `use_token_tiles(module)` makes every linear in `module` (a tower: its blocks,
patch embedding, merger) run its matmul over fixed-size token tiles (mmenc.layers.token_tiles), so a
token's output does not depend on how many other tokens share the call. The engine applies it when
MultiModalConfig(batch_invariant=True); towers need no code of their own for it.

What they hold: `linear_names`, `linear_backends_of` (linears per backend), `linear_states_nbytes`.
"""
from collections.abc import Callable

import torch.nn as nn

from mmenc.backends.linear import LinearBackend, LinearBackendEnum, get_linear_backend_class
from mmenc.layers.linear import LinearBase
from mmenc.layers.token_tiles import NARROW_OUT_FEATURES, NARROW_TOKEN_TILE, TOKEN_TILE, TRITON_GEMM


def use_token_tiles(module: nn.Module, tile: int | None = TOKEN_TILE, narrow_tile: int | None = NARROW_TOKEN_TILE,
                    narrow_below: int = NARROW_OUT_FEATURES) -> int:
    """Run every linear of `module` over token tiles of `tile` tokens, those with fewer than
    `narrow_below` output features (per rank) over `narrow_tile` (None: `tile`) unless their weight is
    on the CPU (narrow tiles only pay off on GPUs, against partly idle waves of blocks; on a CPU they
    would only add padding); tile None: plain matmuls again. Each linear's tile depends only on its
    own shape and device type. Returns how many linears it set. Call before compiling or capturing
    CUDA graphs."""
    for name, value in (("tile", tile), ("narrow_tile", narrow_tile)):
        if value is not None and (not isinstance(value, int) or value < 0):
            raise ValueError(f"{name}={value!r} must be a positive number of tokens, TRITON_GEMM (0: the Triton "
                             f"batch-invariant GEMM) or None ({'switch tiling off' if name == 'tile' else 'use tile'})")
    linears = [m for m in module.modules() if isinstance(m, LinearBase)]
    native = get_linear_backend_class(LinearBackendEnum.NATIVE)
    packed = [m.prefix or type(m).__name__ for m in linears
              if tile is not None and m.linear_backend not in (None, native)]
    if packed:
        raise ValueError(f"token tiles run on plain weights, but {packed[0]} (and {len(packed) - 1} more) runs on "
                         f"the {linears[0].linear_backend.enum.name} linear backend; prepare the linears with "
                         f"NATIVE (MultiModalConfig(linear_backend='native')) or call restore_linears first")
    for m in linears:
        narrow = (tile not in (None, TRITON_GEMM) and narrow_tile is not None and m.weight.shape[0] < narrow_below
                  and m.weight.device.type != "cpu")
        m.token_tile = narrow_tile if narrow else tile
    return len(linears)


def prepare_linears(module: nn.Module, backend: LinearBackendEnum | type[LinearBackend],
                    include: Callable[[str], bool] | None = None) -> int:
    """Hand every linear of `module` (those whose name `include` accepts; all by default) to `backend` once,
    after its weights are loaded: the backend's LinearState replaces the loaded weight (no second copy is
    kept; `weight.shape` stays [out, in]), and forward calls the backend. Linears on the meta device are
    left alone. Returns how many it set."""
    cls = get_linear_backend_class(backend) if isinstance(backend, LinearBackendEnum) else backend
    count = 0
    for name, m in module.named_modules():
        if not isinstance(m, LinearBase) or m.weight.device.type == "meta":
            continue
        if include is not None and not include(name):
            continue
        if m.linear_state is not None:
            _restore(m)
        state = cls.prepare(m.weight, m.kernel_bias)
        if state.weight is not m.weight:  # repacked: the loaded tensor goes (and loading into it is refused)
            m.plain_weight_loader = getattr(m.weight, "weight_loader", m.weight_loader)
            m.weight = nn.Parameter(state.weight, requires_grad=False)
            m.weight.weight_loader = _packed_loader(m, cls)
            state.weight = m.weight
        m.linear_backend, m.linear_state = cls, state
        count += 1
    return count


def restore_linears(module: nn.Module) -> type[LinearBackend] | None:
    """Give every prepared linear of `module` its plain weight back (to load other weights into it);
    returns the backend they were prepared for (None: none was), for `prepare_linears` afterwards."""
    backend = None
    for m in module.modules():
        if isinstance(m, LinearBase) and m.linear_state is not None:
            backend = m.linear_backend
            _restore(m)
    return backend


def linear_names(module: nn.Module) -> list[str]:
    """Names of the parallel linears of `module`, in module order."""
    return [name for name, m in module.named_modules() if isinstance(m, LinearBase)]


def linear_plan(module: nn.Module) -> dict[str, type[LinearBackend]]:
    """{linear name: the backend it is prepared for} over the prepared linears of `module` (several
    backends may share a tower: FP8 on some blocks, NATIVE elsewhere); `prepare_plan` applies one again."""
    return {name: m.linear_backend for name, m in module.named_modules()
            if isinstance(m, LinearBase) and m.linear_state is not None}


def prepare_plan(module: nn.Module, plan: dict[str, type[LinearBackend]]) -> int:
    """Prepare each linear named in `plan` for its backend (after `restore_linears` and a load)."""
    backends = {b for b in plan.values()}
    return sum(prepare_linears(module, b, include=lambda n, b=b: plan.get(n) is b) for b in backends)


def _restore(m: LinearBase) -> None:
    weight = m.linear_backend.restore(m.linear_state)
    if weight is not m.weight:
        m.weight = nn.Parameter(weight, requires_grad=False)
        m.weight.weight_loader = m.plain_weight_loader
    m.linear_backend = m.linear_state = None


def _packed_loader(m: LinearBase, backend: type[LinearBackend]):
    def refuse(param, loaded, shard_id=None):
        raise ValueError(f"{m._pname(param)} is packed for the {backend.enum.name} linear backend; load weights "
                         f"through VisionTower.load_weights (it restores plain weights first) or call "
                         f"mmenc.layers.linear_kernels.restore_linears(tower) before loading")
    return refuse


def linear_backends_of(module: nn.Module) -> dict[str, int]:
    """{backend name: linears} over the linears of `module` ("unprepared": F.linear on loaded weights)."""
    counts: dict[str, int] = {}
    for m in module.modules():
        if isinstance(m, LinearBase):
            name = m.linear_backend.enum.name if m.linear_backend is not None else "unprepared"
            counts[name] = counts.get(name, 0) + 1
    return counts


def linear_states_nbytes(module: nn.Module) -> int:
    """Bytes the weights of `module` take as it runs: prepared linears as their backend keeps them (packed
    layouts with their padding), every other parameter and buffer as it is."""
    linears = [m for m in module.modules() if isinstance(m, LinearBase) and m.linear_state is not None]
    held = {id(t) for m in linears for t in (m.weight, m.bias) if t is not None}
    rest = sum(t.nbytes for t in [*module.parameters(), *module.buffers()] if id(t) not in held and not t.is_mkldnn)
    return rest + sum(m.linear_backend.state_nbytes(m.linear_state) for m in linears)
