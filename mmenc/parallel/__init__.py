"""Parallelism in one place: the data-parallel path (assign images -> per-rank sub-packs -> merge by
index) shared by worker processes and torchrun ranks, the worker-process group and the transport
below it, and tensor-parallel mode resolution. Knows the tower only through a TowerRecipe."""
from mmenc.parallel.data import (assign_images, flatten_output, merge_outputs, pack_for_rank, patch_counts,
                                 restore_order, split_pack, unflatten_output)
from mmenc.parallel.modes import resolve_tp_mode
from mmenc.parallel.rank import (TowerRecipe, build_rank_tower, check_same_call, gather_outputs, gather_pieces,
                                 run_data_parallel, run_rank_tower)
from mmenc.parallel.workers import WorkerError, WorkerGroup

__all__ = ["TowerRecipe", "WorkerError", "WorkerGroup", "assign_images", "build_rank_tower", "check_same_call",
           "flatten_output", "gather_outputs", "gather_pieces", "merge_outputs", "pack_for_rank", "patch_counts",
           "resolve_tp_mode", "restore_order", "run_data_parallel", "run_rank_tower", "split_pack",
           "unflatten_output"]
