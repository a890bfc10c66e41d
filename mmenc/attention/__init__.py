"""Encoder attention: one layer (MMEncoderAttention) over the kernel backends of mmenc.backends,
chosen by the platform of the device it runs on. Towers import from here only: the layer, and
`make_cu_seqlens` (the packed layout the layer takes, built once per forward); backend names,
the registry and the pack's host view are mmenc.backends'."""
from mmenc.attention.layer import MMEncoderAttention
from mmenc.backends.packing import make_cu_seqlens

__all__ = ["MMEncoderAttention", "make_cu_seqlens"]
