"""Intel GPUs (torch's XPU device)."""
import torch

from mmenc.attention.backend_enum import AttentionBackendEnum as B
from mmenc.platforms.device_info import DeviceInfo
from mmenc.platforms.interface import Platform


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    custom_op_key = "xpu"

    def _detect_device_info(self) -> DeviceInfo:
        return DeviceInfo(type="xpu", vendor="intel")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.TORCH_SDPA, B.FLEX_ATTENTION, B.NAIVE]
