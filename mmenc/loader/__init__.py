"""Checkpoint reading: config.json and only the vision tower's safetensors tensors, memory-mapped."""
from mmenc.loader.checkpoint import (checkpoint_folder, iter_tower_tensors, load_tower_weights, read_config,
                                     read_json_if_present, tensor_files, tower_prefix)

__all__ = ["checkpoint_folder", "iter_tower_tensors", "load_tower_weights", "read_config", "read_json_if_present",
           "tensor_files", "tower_prefix"]
