"""What a backend needs to know about a device to say whether it can run there."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """type: torch device type ("cuda" also for ROCm, "cpu", "xpu", "xla", or a plugin's);
    capability: CUDA compute capability (major, minor) on NVIDIA GPUs;
    arch: ROCm gfx architecture ("gfx90a", "gfx942", ...) on AMD GPUs;
    vendor: "nvidia", "amd", "intel", "google", "cpu" or a plugin's name."""

    type: str
    vendor: str
    capability: tuple[int, int] | None = None
    arch: str | None = None

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == "nvidia"

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    def describe(self) -> str:
        if self.capability is not None:
            return f"{self.vendor} {self.type} (compute capability {self.capability[0]}.{self.capability[1]})"
        if self.arch is not None:
            return f"{self.vendor} {self.type} ({self.arch})"
        return self.type if self.vendor == self.type else f"{self.vendor} {self.type}"
