"""CPU: torch SDPA (grouped by segment length), the reference as a last resort. FlexAttention is
not offered: its compiled CPU kernel fails with dynamic pack lengths (see backends/flex.py).
Linears: oneDNN with packed weights (0.67-0.83x F.linear's time in float32, 0.88-0.95x in bfloat16 on
an AVX-512 EPYC; BENCHMARKS.md, CPU), F.linear where oneDNN cannot run (and in batch-invariant mode)."""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.backends.linear import LinearBackendEnum as L
from mmenc.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    custom_op_key = "cpu"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("cpu")

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        return [B.TORCH_SDPA, B.NAIVE]

    def linear_priority(self, dtype: torch.dtype, quantization: str | None = None) -> list[L]:
        return [L.ONEDNN, L.NATIVE]

    def compiles_elementwise(self) -> bool:
        """torch's CPU rms_norm and QuickGELU are unfused ops: 17.2 ms eager against 2.1 compiled on a [5476, 1280]
        bf16 norm block, 7.0 against 3.7 on a [2308, 4096] QuickGELU one (mmenc/layers/compiled_kernels.py)."""
        return True

    def prepare_host(self, cpu_malloc: str = "tuned") -> str | None:
        """glibc's malloc keeps freed blocks (mmenc/platforms/host_malloc.py) unless cpu_malloc="system"."""
        if cpu_malloc == "system":
            return None
        from mmenc.platforms.host_malloc import keep_freed_blocks

        return keep_freed_blocks()
