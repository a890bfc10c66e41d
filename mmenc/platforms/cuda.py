"""NVIDIA GPUs. Priorities by compute capability; every default is measured (BENCHMARKS.md)."""
import torch

from mmenc.attention.backend_enum import AttentionBackendEnum as B
from mmenc.platforms.device_info import DeviceInfo
from mmenc.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    custom_op_key = "cuda"

    def _detect_device_info(self) -> DeviceInfo:
        return DeviceInfo(type="cuda", vendor="nvidia", capability=torch.cuda.get_device_capability())

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        capability = self.device_info().capability or (0, 0)
        if capability < (8, 0):
            # Pre-Ampere: no Triton or FlashAttention defaults; xformers is the packed path.
            return [B.TORCH_SDPA, B.XFORMERS, B.NAIVE]
        return [B.FLASH_ATTN, B.TORCH_SDPA, B.TRITON_ATTN, B.TORCH_VARLEN, B.FLEX_ATTENTION, B.XFORMERS, B.NAIVE]
