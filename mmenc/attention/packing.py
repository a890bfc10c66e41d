"""Packing lives on the ground floor (mmenc.backends.packing); this path stays for its users."""
from mmenc.backends.packing import PackInfo, make_cu_seqlens, pack_info

__all__ = ["PackInfo", "make_cu_seqlens", "pack_info"]
