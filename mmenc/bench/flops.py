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
    """with count_flops(tower) as counter: tower(...); counter["flops"] is the total."""
    counter = {"flops": 0}
    handles = []

    def linear_hook(mod, args, out):
        w = mod.weight
        counter["flops"] += 2 * (args[0].numel() // w.shape[1]) * w.shape[0] * w.shape[1]

    def attn_hook(mod, args, kwargs, out):
        q = args[0]
        cu = kwargs.get("cu_seqlens", args[3] if len(args) > 3 else None)
        tokens = q.shape[0] * q.shape[1]
        if cu is None:
            lengths = [q.shape[1]] * q.shape[0]
        else:
            lengths = pack_info(cu, tokens).lengths
        counter["flops"] += 4 * sum(n * n for n in lengths) * mod.num_heads * mod.head_size

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
