"""Encoder attention: one layer (MMEncoderAttention) over the kernel backends of mmenc.backends,
chosen by the platform of the device it runs on."""
from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends import AttentionBackendEnum, BackendChoice, PackInfo, make_cu_seqlens, pack_info

__all__ = ["AttentionBackendEnum", "BackendChoice", "MMEncoderAttention", "PackInfo", "make_cu_seqlens", "pack_info"]
