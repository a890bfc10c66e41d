"""AMD GPUs (torch's ROCm build). aiter's FlashAttention on the MI200/MI300 family (gfx9)."""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.platforms.interface import Platform


class RocmPlatform(Platform):
    name = "rocm"
    device_type = "cuda"  # torch addresses ROCm GPUs as "cuda"
    custom_op_key = "hip"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("cuda")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.ROCM_AITER_FA, B.FLASH_ATTN, B.TORCH_SDPA, B.TRITON_ATTN, B.FLEX_ATTENTION, B.NAIVE]
