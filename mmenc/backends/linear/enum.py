"""The names of the linear (matmul) kernel backends."""
import enum

from mmenc.backends.backend_enum import member_by_name


class LinearBackendEnum(enum.Enum):
    NATIVE = "native"  # F.linear (and the batch-invariant token tiles): the reference, every device
    ONEDNN = "onednn"  # CPU: oneDNN with the weight packed once at load
    FP8 = "fp8"  # CUDA sm89+: FP8 weights and activations (quantization="fp8")
    ALIGNED = "aligned"  # GPUs: F.linear with the input width zero-padded to 16-byte rows

    @classmethod
    def from_name(cls, name: "str | LinearBackendEnum") -> "LinearBackendEnum":
        """Case-insensitive lookup (`"onednn"`, `"ONEDNN"`); members pass through."""
        return member_by_name(cls, name, "linear")
