"""base64 for the service: pybase64 (SIMD) when installed, else the standard library.

A "vllm" answer for a 448px Qwen2.5-VL-7B image is 1.8 MB of torch.save bytes, 2.4 MB of base64.
binascii encodes that in about 6 ms holding the GIL; pybase64 in about 0.15 ms (measured in
docs/serving.md), so with it base64 stops being the service's largest GIL cost. pybase64 is an
optional dependency of the `serve` extra (`pip install pybase64`); `encoder_name()` says which runs.

Without pybase64, `b64encode` encodes in slices of 192 KiB (a multiple of 3, so the slices'
encodings concatenate to the whole one): binascii holds the GIL for a whole call, and slices let
the tower's launcher thread in between instead of waiting behind megabytes.

`b64decode(text)` is `base64.b64decode(text, validate=True)` (the same inputs accepted and refused),
with the standard library's error message when the input is refused."""
import base64
import binascii

try:
    import pybase64 as _fast
except ImportError:  # optional: the standard library does the same, slower
    _fast = None

_SLICE = 3 * 64 * 1024


def encoder_name() -> str:
    return "pybase64" if _fast is not None else "binascii"


def b64encode(data) -> bytes:
    """base64.b64encode(data) of any buffer (bytes, bytearray, memoryview, numpy data)."""
    view = memoryview(data).cast("B")
    if _fast is not None:
        return _fast.b64encode(view)
    if len(view) <= _SLICE:
        return base64.b64encode(view)
    return b"".join(base64.b64encode(view[i:i + _SLICE]) for i in range(0, len(view), _SLICE))


def b64decode(text: str | bytes) -> bytes:
    """Strict decode (no characters outside the alphabet, correct padding); binascii.Error or
    ValueError when refused."""
    if _fast is not None:
        try:
            return _fast.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            pass  # refused: let the standard library say why (it refuses the same inputs)
    return base64.b64decode(text, validate=True)
