"""Encoder attention: one layer, many kernel backends, chosen by the platform."""
from mmenc.attention.backend_enum import AttentionBackendEnum
from mmenc.attention.layer import MMEncoderAttention
from mmenc.attention.packing import PackInfo, make_cu_seqlens, pack_info

__all__ = ["AttentionBackendEnum", "MMEncoderAttention", "PackInfo", "make_cu_seqlens", "pack_info"]
