"""CPU: torch SDPA (grouped by segment length), the reference as a last resort. FlexAttention is
not offered: its compiled CPU kernel fails with dynamic pack lengths (see backends/flex.py)."""
import torch

from mmenc.attention.backend_enum import AttentionBackendEnum as B
from mmenc.platforms.device_info import DeviceInfo
from mmenc.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    custom_op_key = "cpu"

    def _detect_device_info(self) -> DeviceInfo:
        return DeviceInfo(type="cpu", vendor="cpu")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.TORCH_SDPA, B.NAIVE]
