"""Tensor-parallel linears: 2 gloo processes on CPU reproduce the unsharded layers (fp32, rel err < 1e-5),
and the weight loaders read only this rank's slice of a (memory-mapped) checkpoint tensor."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mmenc.distributed import leave_process_group, parallel_state
from mmenc.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear,
                                 ReplicatedLinear, RowParallelLinear)

TOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).norm() / want.norm().clamp_min(1e-12)).item()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert err < TOL, f"{what}: relative error {err:.3e} >= tolerance {TOL:.0e}"


def _load(layer, **tensors):
    for name, t in tensors.items():
        p = getattr(layer, name)
        p.weight_loader(p, t)


class _AllocTracker(TorchDispatchMode):
    """Largest tensor any non-view, out-of-place op allocates while active (views and in-place copies are free)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inplace = func._schema.name.endswith("_") or any(a.alias_info and a.alias_info.is_write
                                                          for a in func._schema.arguments)
        if not func.is_view and not inplace:
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.max_numel = max(self.max_numel, t.numel())
                    self.ops.append((str(func), t.numel()))
        return out


def _worker(rank: int, world: int, init_file: str, ckpt: str):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    parallel_state.set_tp_group(dist.group.WORLD)
    try:
        _check_all(rank, world, ckpt)
        _check_backends(rank, world)
        dist.barrier()  # no rank tears gloo down while the other still reads its last collective
    finally:
        leave_process_group()


def _check_all(rank: int, world: int, ckpt: str):
    torch.manual_seed(0)  # same full tensors on every rank
    hidden, inter, tokens = 12, 16, 7
    x = torch.randn(tokens, hidden)
    w1, b1 = torch.randn(inter, hidden), torch.randn(inter)
    w2, b2 = torch.randn(hidden, inter), torch.randn(hidden)
    n = inter // world
    mine = slice(rank * n, (rank + 1) * n)

    # column: this rank's output slice; gather_output: the whole output
    col = ColumnParallelLinear(hidden, inter)
    _load(col, weight=w1, bias=b1)
    _close(col(x), F.linear(x, w1, b1)[:, mine], "ColumnParallelLinear")
    colg = ColumnParallelLinear(hidden, inter, gather_output=True)
    _load(colg, weight=w1, bias=b1)
    _close(colg(x), F.linear(x, w1, b1), "ColumnParallelLinear(gather_output=True)")

    # row: input slice in, full output (all-reduced, bias once)
    row = RowParallelLinear(inter, hidden)
    _load(row, weight=w2, bias=b2)
    h = F.gelu(F.linear(x, w1, b1))
    _close(row(h[:, mine]), F.linear(h, w2, b2), "RowParallelLinear")
    # column -> row MLP
    _close(row(F.gelu(col(x))), F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), "column->row MLP")

    # merged gate|up
    wg, wu, bg, bu = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(inter), torch.randn(inter)
    merged = MergedColumnParallelLinear(hidden, [inter, inter])
    for i, (w, b) in enumerate([(wg, bg), (wu, bu)]):
        merged.weight.weight_loader(merged.weight, w, i)
        merged.bias.weight_loader(merged.bias, b, i)
    want = torch.cat([F.linear(x, wg, bg)[:, mine], F.linear(x, wu, bu)[:, mine]], dim=-1)
    _close(merged(x), want, "MergedColumnParallelLinear")

    # qkv + attention + row-parallel proj == unsharded attention, fused and separate checkpoints, MHA and GQA
    for heads, kv_heads in [(4, 4), (4, 2), (4, 1)]:
        _check_attention(rank, world, x, heads, kv_heads)

    # loading from a memory-mapped safetensors file allocates nothing larger than this rank's shard
    from safetensors import safe_open
    with safe_open(ckpt, framework="pt") as f:
        qkv_w, proj_w = f.get_tensor("qkv.weight"), f.get_tensor("proj.weight")
        layer = QKVParallelLinear(hidden, 3, 4, 2)
        proj = RowParallelLinear(12, hidden, bias=False)
        with _AllocTracker() as track:
            layer.weight.weight_loader(layer.weight, qkv_w)
            proj.weight.weight_loader(proj.weight, proj_w)
        shard = max(layer.weight.numel(), proj.weight.numel())
        assert track.max_numel <= shard, f"a loader allocated {track.max_numel} elements > shard {shard}: {track.ops}"
        full = F.linear(x, qkv_w)
        sizes = [12, 6, 6]
        want = torch.cat([p.chunk(world, dim=-1)[rank] for p in full.split(sizes, dim=-1)], dim=-1)
        _close(F.linear(x, layer.weight), want, "QKVParallelLinear from safetensors")


def _check_backends(rank: int, world: int):
    """Each linear backend that runs here, on this rank's shard: column, row (bias once, after the all-reduce),
    merged and qkv layers against the unsharded F.linear, at odd sizes."""
    from mmenc.backends.linear import LinearBackendEnum
    from mmenc.layers.linear_kernels import prepare_linears
    from mmenc.platforms.cpu import CpuPlatform

    torch.manual_seed(3)
    hidden, inter, tokens = 18, 22, 13
    x = torch.randn(tokens, hidden)
    w1, b1, w2, b2 = torch.randn(inter, hidden), torch.randn(inter), torch.randn(hidden, inter), torch.randn(hidden)
    n = inter // world
    mine = slice(rank * n, (rank + 1) * n)
    for backend in (LinearBackendEnum.NATIVE, LinearBackendEnum.ONEDNN):
        if CpuPlatform().linear_backend_reasons(backend, torch.float32):
            continue
        col, row = ColumnParallelLinear(hidden, inter), RowParallelLinear(inter, hidden)
        _load(col, weight=w1, bias=b1)
        _load(row, weight=w2, bias=b2)
        qkv = QKVParallelLinear(hidden, 3, 4, 2, bias=False)
        wqkv = torch.randn(24, hidden)
        qkv.weight.weight_loader(qkv.weight, wqkv)
        for layer in (col, row, qkv):
            assert prepare_linears(layer, backend) == 1
        h = F.gelu(F.linear(x, w1, b1))
        _close(col(x), F.linear(x, w1, b1)[:, mine], f"{backend.name} ColumnParallelLinear")
        _close(row(h[:, mine]), F.linear(h, w2, b2), f"{backend.name} RowParallelLinear")
        want = torch.cat([p.chunk(world, dim=-1)[rank] for p in F.linear(x, wqkv).split([12, 6, 6], dim=-1)], -1)
        _close(qkv(x), want, f"{backend.name} QKVParallelLinear")


def _check_attention(rank, world, x, heads, kv_heads):
    hidden, d, tokens = x.shape[1], 3, x.shape[0]
    wq, wk, wv = torch.randn(heads * d, hidden), torch.randn(kv_heads * d, hidden), torch.randn(kv_heads * d, hidden)
    bq, bk, bv = torch.randn(heads * d), torch.randn(kv_heads * d), torch.randn(kv_heads * d)
    wo, bo = torch.randn(hidden, heads * d), torch.randn(hidden)

    def attend(q, k, v, hq, hkv):  # [T, H*D] -> [T, H*D]
        q, k, v = q.view(tokens, hq, d), k.view(tokens, hkv, d), v.view(tokens, hkv, d)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return out.transpose(0, 1).reshape(tokens, hq * d)

    want = F.linear(attend(F.linear(x, wq, bq), F.linear(x, wk, bk), F.linear(x, wv, bv), heads, kv_heads), wo, bo)
    for fused in (True, False):
        qkv = QKVParallelLinear(hidden, d, heads, kv_heads, prefix="attn.qkv")
        assert qkv.num_heads_per_rank == heads // world
        assert qkv.num_kv_heads_per_rank == max(kv_heads // world, 1)
        if fused:
            qkv.weight.weight_loader(qkv.weight, torch.cat([wq, wk, wv]))
            qkv.bias.weight_loader(qkv.bias, torch.cat([bq, bk, bv]))
        else:
            for sid, w, b in [("q", wq, bq), ("k", wk, bk), ("v", wv, bv)]:
                qkv.weight.weight_loader(qkv.weight, w, sid)
                qkv.bias.weight_loader(qkv.bias, b, sid)
        proj = RowParallelLinear(heads * d, hidden)
        _load(proj, weight=wo, bias=bo)
        hq, hkv = qkv.num_heads_per_rank, qkv.num_kv_heads_per_rank
        q, k, v = qkv(x).split([hq * d, hkv * d, hkv * d], dim=-1)
        _close(proj(attend(q, k, v, hq, hkv)), want, f"attention heads={heads} kv_heads={kv_heads} fused={fused}")


@pytest.mark.slow
def test_sharded_layers_match_unsharded(tmp_path):
    from safetensors.torch import save_file
    torch.manual_seed(1)
    ckpt = str(tmp_path / "model.safetensors")
    save_file({"qkv.weight": torch.randn(24, 12), "proj.weight": torch.randn(12, 12)}, ckpt)
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), ckpt), nprocs=2, join=True)


# ---- single process: plain linears and error messages ----

def test_tp1_layers_are_plain_linears():
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 8), torch.randn(6, 8), torch.randn(6)
    for layer in (ReplicatedLinear(8, 6), ColumnParallelLinear(8, 6), RowParallelLinear(8, 6)):
        _load(layer, weight=w, bias=b)
        _close(layer(x), F.linear(x, w, b), type(layer).__name__)


def test_layers_take_no_tp_size_argument():
    """The tensor-parallel size comes from the parallel state only (set_tp_group), never a parameter."""
    for cls in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(TypeError, match="tp_size"):
            cls(8, 6, tp_size=1)


def test_shape_and_shard_errors_name_the_value():
    layer = ColumnParallelLinear(8, 6, prefix="mlp.fc1")
    with pytest.raises(ValueError, match=r"mlp.fc1.weight has shape \(6, 7\); expected \(6, 8\)"):
        layer.weight.weight_loader(layer.weight, torch.randn(6, 7))
    qkv = QKVParallelLinear(8, 2, 4, prefix="attn.qkv")
    with pytest.raises(ValueError, match=r"shard_id='x' is not valid"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(8, 8), "x")
    with pytest.raises(ValueError, match=r"fused qkv tensor has 20 rows; expected 24"):
        qkv.weight.weight_loader(qkv.weight, torch.randn(20, 8))
    with pytest.raises(ValueError, match=r"mlp.fc1.weight has shape \(9, 8\); expected 6 rows"):
        layer.weight.weight_loader(layer.weight, torch.randn(9, 8))  # larger than the layer: not sliced silently
    row = RowParallelLinear(6, 8, prefix="mlp.fc2")
    with pytest.raises(ValueError, match=r"mlp.fc2.weight has shape \(8, 7\); expected 6 columns"):
        row.weight.weight_loader(row.weight, torch.randn(8, 7))
    merged = MergedColumnParallelLinear(8, [4, 4])
    with pytest.raises(ValueError, match="needs shard_id"):
        merged.weight.weight_loader(merged.weight, torch.randn(4, 8))
    with pytest.raises(ValueError, match="shard_id=2 is not valid"):
        merged.weight.weight_loader(merged.weight, torch.randn(4, 8), 2)


def test_indivisible_sizes_raise(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_tp_size", lambda: 3)
    monkeypatch.setattr("mmenc.layers.linear.get_tp_size", lambda: 3)
    monkeypatch.setattr("mmenc.layers.linear.get_tp_rank", lambda: 0)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible by the tensor-parallel size 3"):
        QKVParallelLinear(8, 2, 4)
    with pytest.raises(ValueError, match=r"num_kv_heads=2 is fewer than the tensor-parallel size 3"):
        QKVParallelLinear(8, 2, 6, 2)
    with pytest.raises(ValueError, match=r"in_features=8 is not divisible"):
        RowParallelLinear(8, 6)
