"""The ground floor of encoder attention: kernel backends and everything they need, importing
nothing of mmenc from outside this folder but the bottom floor's helpers (mmenc.utils).

    backend_enum.py   AttentionBackendEnum (+ from_name)
    packing.py        make_cu_seqlens / pack_info: the host view of a pack, computed once per forward;
                      sub_packs: its per-length-class / batch-invariant pieces
    device.py         DeviceInfo and probe_device, the one function that reads a device's kind
    choice.py         BackendChoice: main backend + the short-segment one (+ batch invariance)
    base.py           the backend contract; one file per backend; registry.py looks them up
    kernels/          mmenc's own Triton kernel (TRITON_ATTN) and its host-side planning
    dispatch.py       the custom op mmenc::mm_encoder_attention: applies a BackendChoice per segment class

Platforms (mmenc.platforms) rank these backends; the layer (mmenc.attention) uses a platform.
"""
from mmenc.backends.backend_enum import AttentionBackendEnum
from mmenc.backends.base import AttentionBackend
from mmenc.backends.choice import SHORT_SEQLEN_MAX, BackendChoice
from mmenc.backends.device import DeviceInfo, probe_device
from mmenc.backends.packing import PackInfo, make_cu_seqlens, pack_info
from mmenc.backends.registry import get_backend_class, register_backend, registered_backends

__all__ = ["AttentionBackend", "AttentionBackendEnum", "BackendChoice", "DeviceInfo", "PackInfo", "SHORT_SEQLEN_MAX",
           "get_backend_class", "make_cu_seqlens", "pack_info", "probe_device", "register_backend",
           "registered_backends"]
