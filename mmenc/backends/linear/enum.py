"""The names of the linear (matmul) kernel backends."""
import enum


class LinearBackendEnum(enum.Enum):
    NATIVE = "native"  # F.linear (and the batch-invariant token tiles): the reference, every device
    ONEDNN = "onednn"  # CPU: oneDNN with the weight packed once at load
    FP8 = "fp8"  # CUDA sm89+: FP8 weights and activations (quantization="fp8")

    @classmethod
    def from_name(cls, name: "str | LinearBackendEnum") -> "LinearBackendEnum":
        """Case-insensitive lookup (`"onednn"`, `"ONEDNN"`); members pass through."""
        if isinstance(name, cls):
            return name
        if not isinstance(name, str):
            raise ValueError(f"linear backend must be a name or LinearBackendEnum, got {name!r}")
        key = name.strip().upper().replace("-", "_")
        if key in cls.__members__:
            return cls[key]
        raise ValueError(f"unknown linear backend {name!r}; valid names: {', '.join(cls.__members__)}")
