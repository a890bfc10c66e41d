"""CPU: torch SDPA (grouped by segment length), the reference as a last resort. FlexAttention is
not offered: its compiled CPU kernel fails with dynamic pack lengths (see backends/flex.py)."""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    custom_op_key = "cpu"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("cpu")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.TORCH_SDPA, B.NAIVE]
