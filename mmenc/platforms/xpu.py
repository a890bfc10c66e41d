"""Intel GPUs (torch's XPU device)."""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.platforms.interface import Platform


class XpuPlatform(Platform):
    name = "xpu"
    device_type = "xpu"
    custom_op_key = "xpu"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("xpu")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.TORCH_SDPA, B.FLEX_ATTENTION, B.NAIVE]
