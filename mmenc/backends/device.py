"""What a backend needs to know about a device to say whether it can run there, and the one
function that reads it from the hardware (`probe_device`, cached per device)."""
import dataclasses
import functools

import torch


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """type: torch device type ("cuda" also for ROCm, "cpu", "xpu", "xla", or a plugin's);
    capability: CUDA compute capability (major, minor) on NVIDIA GPUs;
    arch: ROCm gfx architecture ("gfx90a", "gfx942", ...) on AMD GPUs;
    vendor: "nvidia", "amd", "intel", "google", "cpu" or a plugin's name;
    features: on CPUs, the instruction sets kernels care about (CPU_FEATURES: "avx2", "avx512",
    "avx512_bf16" (bf16 dot products), "amx" (AMX tiles, bf16/int8), "amx_fp16")."""

    type: str
    vendor: str
    capability: tuple[int, int] | None = None
    arch: str | None = None
    features: frozenset[str] = frozenset()

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    @property
    def bf16_dot(self) -> bool:
        """A CPU with bfloat16 dot products in hardware (AVX512-BF16 or AMX), not emulated ones."""
        return bool(self.features & {"avx512_bf16", "amx"})

    def describe(self) -> str:
        if self.capability is not None:
            return f"{self.vendor} {self.type} (compute capability {self.capability[0]}.{self.capability[1]})"
        if self.arch is not None:
            return f"{self.vendor} {self.type} ({self.arch})"
        return self.type if self.vendor == self.type else f"{self.vendor} {self.type}"


def probe_device(device: torch.device | str) -> DeviceInfo:
    """The DeviceInfo of `device`, read from the hardware once per device (the one place that
    asks torch what a device is; platforms and backends call this, never torch.cuda directly).
    "cuda" without an index means the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _probe(device)


@functools.cache
def _probe(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        if torch.version.hip:
            arch = torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]
            return DeviceInfo(type="cuda", vendor="amd", arch=arch)
        return DeviceInfo(type="cuda", vendor="nvidia", capability=torch.cuda.get_device_capability(device))
    if device.type == "cpu":
        return DeviceInfo(type="cpu", vendor="cpu", features=cpu_features())
    return DeviceInfo(type=device.type, vendor=_VENDORS.get(device.type, device.type))


# feature name -> torch's probe of this CPU (cpuinfo, through torch.cpu)
CPU_FEATURES = {"avx2": "_is_avx2_supported", "avx512": "_is_avx512_supported",
                "avx512_bf16": "_is_avx512_bf16_supported", "amx": "_is_amx_tile_supported",
                "amx_fp16": "_is_amx_fp16_supported"}


def cpu_features() -> frozenset[str]:
    """The CPU_FEATURES this CPU has (probes this torch lacks count as absent)."""
    return frozenset(name for name, probe in CPU_FEATURES.items() if getattr(torch.cpu, probe, lambda: False)())


# Vendors of the device types whose DeviceInfo holds nothing but the type.
_VENDORS = {"cpu": "cpu", "xpu": "intel", "xla": "google"}
