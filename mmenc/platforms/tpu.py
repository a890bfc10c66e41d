"""Google TPUs through torch_xla: the Pallas flash kernel with segment ids."""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.platforms.interface import Platform


class TpuPlatform(Platform):
    name = "tpu"
    device_type = "xla"
    custom_op_key = "tpu"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("xla")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.PALLAS, B.TORCH_SDPA, B.NAIVE]
