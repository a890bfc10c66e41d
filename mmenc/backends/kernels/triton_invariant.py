"""TRITON_ATTN in batch-invariant mode: one fixed launch configuration, each segment blocked on its own.

    varlen_attention_invariant(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], cu_seqlens int32 [N+1],
                               scale float) -> out [T, Hq, D] (contiguous, q's dtype)

The tuned path (`triton_varlen_attn.launch`) is not batch invariant: its first call per process
times candidate configs (another process may keep another one), it picks the config from the
pack's longest segment, and it packs consecutive short segments into one tile, so a segment's
blocking depends on its neighbours. Here, for every pack:
  * the config is a constant per head class (`INVARIANT_CONFIGS`), never timed, the same on every
    rank and in every process; no TMA (one load path whatever the tensors' alignment);
  * segments of <= INVARIANT_WINDOW tokens run the windows kernel, one block each (a window's
    softmax is one pass over its own rows);
  * longer segments run the tile kernel over tiles of their own, cut from the segment's start,
    each attending to the segment in BLOCK_N-key blocks counted from its start (unmasked blocks
    first, then the masked tail), never sharing a tile with a neighbour.
Which kernel a segment gets, how it is cut and the order of every reduction then depend only on
its length and the head class, not on its offset, on the other segments or on the pack's size,
so the dispatcher may run a whole length class in one call (no fixed-shape chunks, no padding).
"""
import torch

from mmenc.backends.kernels import triton_varlen_attn as tva
from mmenc.backends.kernels.triton_attn_plan import head_split, invariant_configs, segment_tables
from mmenc.backends.packing import pack_info


def varlen_attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                               scale: float) -> torch.Tensor:
    """See the module docstring. Eager (the dispatcher's custom op is what compiled towers trace)."""
    q, k, v, out = tva.checked_inputs(q, k, v)
    (num_tokens, hq, d), hkv = q.shape, k.shape[1]
    if num_tokens == 0:
        return out
    info = pack_info(cu_seqlens, num_tokens)
    windows_cfg, tiles_cfg = invariant_configs(d)
    windows, tiles, seg_ids = segment_tables(info, windows_cfg.block_m, tiles_cfg.block_m, tiles_cfg.block_n,
                                             q.device)
    strides = [s for x in (q, k, v, out) for s in x.stride()[:2]]  # (token, head) of each
    qk_scale = scale * tva._LOG2E
    align = tva._stride_align(q, k, v, out)
    for config, work in ((windows_cfg, windows.shape[0]), (tiles_cfg, tiles.shape[0])):
        if not work:
            continue
        da, db = head_split(d, config.split)
        common = {"GROUP": hq // hkv, "HEAD_DIM": d, "DA": da, "DB": max(db, 16), "HAS_B": db > 0, "ALIGN": align,
                  "num_warps": config.num_warps, "num_stages": config.num_stages}
        if config is windows_cfg:
            grid = (tva.triton.cdiv(work, config.windows), hq)
            tva._windows_kernel[grid](q, k, v, out, windows, work, qk_scale, *strides, BLOCK=config.block_m,
                                      PER_PROGRAM=config.windows, PAIRS=True, **common)
        else:
            tva._kernel[(work, hq)](q, k, v, out, tiles, seg_ids, k, k, v, v, qk_scale, *strides,
                                    BLOCK_M=config.block_m, BLOCK_N=config.block_n, USE_TMA=False, **common)
    return out

