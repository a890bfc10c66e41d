"""Tensor-parallel state and collectives (parallel_state), and joining a process group (env)."""
from mmenc.distributed.env import (DistEnv, init_from_env, init_process_group, launched_distributed,
                                   leave_process_group)
from mmenc.distributed.parallel_state import (get_tp_group, get_tp_rank, get_tp_size, set_tp_group, tp_all_gather,
                                              tp_all_reduce)

__all__ = ["DistEnv", "get_tp_group", "get_tp_rank", "get_tp_size", "init_from_env", "init_process_group",
           "launched_distributed", "leave_process_group", "set_tp_group", "tp_all_gather", "tp_all_reduce"]
