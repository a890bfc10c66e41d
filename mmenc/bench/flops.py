"""Count a tower forward's floating-point work: matmuls of linear layers plus attention.

Linear-like modules (a 2-D `weight` applied as x @ W^T) count 2 * rows * in * out; each
MMEncoderAttention counts 4 * sum(len_i^2) * heads * head_size over its pack. Norms, rotary and
activations are left out (they are memory-bound and small), so this is the matmul work the floor
`flops / matmul rate` is computed from.
"""
import contextlib

import torch

from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends.packing import pack_info


@contextlib.contextmanager
def count_flops(module: torch.nn.Module):
    """with count_flops(tower) as counter: tower(...); counter["flops"] is the total, split as "linear_flops"
    and "attention_flops"; "linear_out_bytes": the bytes the linears' outputs take (elementwise floor)."""
    counter = {"flops": 0, "linear_flops": 0, "attention_flops": 0, "linear_out_bytes": 0}
    handles = []

    def linear_hook(mod, args, out):
        w = mod.weight
        x = args[0].data if isinstance(args[0], tuple) else args[0]  # QuantizedRows: an FP8 input
        flops = 2 * x.shape[:-1].numel() * w.shape[0] * w.shape[1]
        counter["flops"] += flops
        counter["linear_flops"] += flops
        if isinstance(out, torch.Tensor):
            counter["linear_out_bytes"] += out.numel() * out.element_size()

    def attn_hook(mod, args, kwargs, out):
        q = args[0]
        cu = kwargs.get("cu_seqlens", args[3] if len(args) > 3 else None)
        tokens = q.shape[0] * q.shape[1]
        if cu is None:
            lengths = [q.shape[1]] * q.shape[0]
        else:
            lengths = pack_info(cu, tokens).lengths
        flops = 4 * sum(n * n for n in lengths) * mod.num_heads * mod.head_size
        counter["flops"] += flops
        counter["attention_flops"] += flops

    for m in module.modules():
        if isinstance(m, MMEncoderAttention):
            handles.append(m.register_forward_hook(attn_hook, with_kwargs=True))
        elif isinstance(getattr(m, "weight", None), torch.Tensor) and m.weight.dim() == 2 and not isinstance(
                m, torch.nn.Embedding) and "Embedding" not in type(m).__name__:
            handles.append(m.register_forward_hook(linear_hook))
    try:
        yield counter
    finally:
        for h in handles:
            h.remove()
