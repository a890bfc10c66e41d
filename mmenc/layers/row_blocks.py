"""Row blocks: a row-wise computation whose intermediate would be large runs over blocks of rows, so
its largest intermediate is one block's, not the whole call's.

A tower's widest intermediates (an MLP's hidden activations, Ovis2's visual-vocabulary logits) are
[tokens, wide]; with tens of thousands of tokens one such tensor takes gigabytes, and a CUDA-graph
pool keeps a segment of that size for the whole capture. Every op in such a computation treats rows
independently (linears, norms, activations, softmax), so running it block by block gives the same
rows; only the matmuls' kernels may change with the row count (float rounding, not bitwise).

`MAX_INTERMEDIATE_BYTES` is the default budget, 1.5 GiB: below it (every workload of docs/towers.md
except the widest) nothing splits. A lower budget, 512 MiB (`LOW_INTERMEDIATE_BYTES`), makes a CUDA
graph's pool smaller: a pool keeps the capture's largest intermediates for the graph's life and
reuses only the blocks it already holds, so an intermediate wider than everything before it costs a
segment of its own; below 512 MiB an MLP block's hidden activations fit the segments the attention
left free. Measured on an H200 (docs/towers.md, "Graph pools under transformers' peak"): HunyuanOCR
on 8 pages 3.14 -> 2.79 GiB for 0.9% more time, so its tower uses it; elsewhere it cost 1-4% (GLM-OCR,
Pixtral-Large, InternViT-6B) where the default already stays under transformers' peak, so it is
not the default. `mmenc bench --max-intermediate-bytes N` sets any budget for a run.
A module that splits takes its budget as the attribute `max_intermediate_bytes` (None: never split);
`set_max_intermediate_bytes(module, n)` sets it on every such submodule. `map_rows` runs any row-wise
function (a projector: linear -> act -> linear) over row blocks into one output.

The block count is a Python int derived from the (possibly symbolic) row count: torch.compile guards
on it (a new count recompiles, a new row count with the same count does not: `split_rows`); no host
sync, so the blocks capture in CUDA graphs.
"""
import torch
import torch.nn as nn

MAX_INTERMEDIATE_BYTES = 3 << 29  # 1.5 GiB of intermediates alive at once, per call or per block
LOW_INTERMEDIATE_BYTES = 1 << 29  # 512 MiB: smaller graph pools for 1-4% of the time (above)


def num_row_blocks(rows: int, bytes_per_row: int, budget: int | None) -> int:
    """How many near-equal row blocks keep intermediates of bytes_per_row per row (all those alive at
    once, e.g. an MLP's hidden activations before and after the activation) within `budget` bytes per
    block (1: leave it whole; budget None: never split). Works on SymInts."""
    if budget is None:
        return 1
    if budget < 1:
        raise ValueError(f"max_intermediate_bytes={budget}; expected a positive byte count or None (never split)")
    total = rows * bytes_per_row
    if total <= budget:
        return 1
    return min(rows, -(-total // budget))


def set_max_intermediate_bytes(module: nn.Module, budget: int | None) -> int:
    """Set `max_intermediate_bytes` on every submodule of `module` that has it (blocks, heads); returns
    how many. For tests (a tiny budget forces the split) and memory-tight deployments; call before
    compiling (compiled code keeps the value it was traced with, guarded)."""
    if budget is not None and budget < 1:
        raise ValueError(f"max_intermediate_bytes={budget}; expected a positive byte count or None (never split)")
    found = [m for m in module.modules() if hasattr(m, "max_intermediate_bytes")]
    for m in found:
        m.max_intermediate_bytes = budget
    return len(found)


def split_rows(x: torch.Tensor, blocks: int) -> list[torch.Tensor]:
    """x [rows, ...] as `blocks` views of consecutive rows: rows // blocks each, the last also the rest.
    (Not tensor_split: its sizes depend on rows % blocks, on which torch.compile would guard.)"""
    size = x.shape[0] // blocks
    return [x[i * size:(i + 1) * size] for i in range(blocks - 1)] + [x[(blocks - 1) * size:]]


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., features] as a [rows, features] view (never a copy: writes to its rows reach x; a layout
    that cannot be viewed so raises)."""
    return x.view(-1, x.shape[-1])


def map_rows(fn, x: torch.Tensor, bytes_per_row: int, budget: int | None) -> torch.Tensor:
    """fn(x) for a row-wise fn (row i of the result depends on row i of x only), x [rows, features] ->
    [rows, out_features]: whole when rows * bytes_per_row (fn's intermediates alive at once, its output
    included) fits `budget`, else over row blocks, each block's result copied into its rows of one output.
    Alive at once then: the output and one block's intermediates (not all rows' intermediates)."""
    blocks = num_row_blocks(x.shape[0], bytes_per_row, budget)
    if blocks == 1:
        return fn(x)
    parts = split_rows(x, blocks)
    first = fn(parts[0])
    out = first.new_empty(x.shape[0], *first.shape[1:])
    dst = split_rows(out, blocks)
    dst[0].copy_(first)
    del first
    for rows, into in zip(parts[1:], dst[1:]):
        into.copy_(fn(rows))
    return out
