"""DeviceInfo moved to the ground floor (mmenc.backends.device); this name stays for plugins."""
from mmenc.backends.device import DeviceInfo, probe_device

__all__ = ["DeviceInfo", "probe_device"]
