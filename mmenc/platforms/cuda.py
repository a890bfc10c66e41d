"""NVIDIA GPUs. Priorities by compute capability; the Ampere-and-later defaults follow the H200
measurements in BENCHMARKS.md (bf16, 16 heads x 64/72/80, 12 x 128):

  long segments (8 x 5476 tokens): FLASH_ATTN (FA4) 470-692 TFLOP/s > TORCH_SDPA (cuDNN) 335-597
      > TRITON_ATTN 276-466 > TORCH_VARLEN 232-351 > FLEX_ATTENTION 169-331
  short segments (684 x 64-token windows): TRITON_ATTN 51-99 ~ TORCH_SDPA 53-93 > TORCH_VARLEN
      42-78 > FLEX_ATTENTION 42-67 > FLASH_ATTN (FA4) 15-32
so packs whose longest segment is short (window layers) use TRITON_ATTN (or TORCH_SDPA), others
the FlashAttention family when installed, else cuDNN through TORCH_SDPA.
"""
import torch

from mmenc.backends import AttentionBackendEnum as B
from mmenc.backends import DeviceInfo, probe_device
from mmenc.backends.linear import LinearBackendEnum as L
from mmenc.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    custom_op_key = "cuda"

    def _detect_device_info(self) -> DeviceInfo:
        return probe_device("cuda")

    def _ampere_or_later(self) -> bool:
        return (self.device_info().capability or (0, 0)) >= (8, 0)

    def vit_attn_priority(self, dtype: torch.dtype) -> list[B]:
        if not self._ampere_or_later():
            # Pre-Ampere: no Triton or FlashAttention defaults; xformers is the packed path.
            return [B.TORCH_SDPA, B.XFORMERS, B.NAIVE]
        return [B.FLASH_ATTN, B.TORCH_SDPA, B.TRITON_ATTN, B.TORCH_VARLEN, B.FLEX_ATTENTION, B.XFORMERS, B.NAIVE]

    def vit_attn_short_priority(self, dtype: torch.dtype) -> list[B]:
        if not self._ampere_or_later():
            return []
        return [B.TRITON_ATTN, B.TORCH_SDPA]

    def fused_kernel_reasons(self, dtype: torch.dtype) -> list[str]:
        from mmenc.backends.kernels.fused_rows import available

        reasons = [why] if (why := available()) else []
        if not self._ampere_or_later():
            reasons.append(f"the fused Triton row kernels are offered on Ampere (sm80) or later; this is "
                           f"{self.device_info().describe()}")
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            reasons.append(f"dtype {dtype} is not supported (bfloat16, float16, float32)")
        return reasons

    def linear_priority(self, dtype: torch.dtype, quantization: str | None = None) -> list[L]:
        # ALIGNED: cuBLAS's fast kernels want 16-byte rows (Qwen2.5-VL's 3420-wide MLP has 6840-byte ones);
        # NATIVE where it cannot run (batch-invariant mode: NATIVE's token tiles align rows themselves)
        return [L.FP8] if quantization in ("fp8", "fp8-all") else [L.ALIGNED, L.NATIVE]
