"""Checks of the Encoder's arguments (errors name the value, the expectation and the fix) and of
its outputs (non-finite embeddings)."""
import math

import torch

from mmenc.engine.tower import DTYPE_NAMES
from mmenc.logger import init_logger

logger = init_logger(__name__)


class NonFiniteOutputError(RuntimeError):
    """The tower produced NaN or infinite embeddings (raised under Encoder(strict=True))."""


def check_dtype(dtype) -> None:
    """"auto", a floating dtype's name (see tower.resolve_dtype) or a floating torch.dtype."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype={dtype} is not a floating dtype; use torch.bfloat16, torch.float16, "
                             f"torch.float32 or 'auto'")
    elif not isinstance(dtype, str) or (dtype != "auto" and dtype.lower() not in DTYPE_NAMES):
        raise ValueError(f"dtype={dtype!r} is not valid; expected 'auto', a floating torch.dtype or one of "
                         f"{', '.join(DTYPE_NAMES)}")


def check_positive_int(name: str, value, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1 (not a bool, float or str); {fix}")


def check_timeout(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name}={value!r} must be a positive, finite number of seconds, e.g. 600")


def all_finite(embeddings: torch.Tensor) -> torch.Tensor:
    """A 0-dim flag on embeddings' device: False if any element may be NaN or infinite. One sum (float32
    accumulation), not torch.isfinite(x).all(), whose bool tensor as large as the embeddings (Pixtral-Large,
    8 images: 0.22 GiB) would add to the call's peak memory. A NaN or an infinity always makes the sum
    non-finite; a sum of finite values past float32's range also does (check_finite then finds no bad row)."""
    wide = embeddings.dtype if embeddings.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.isfinite(embeddings.sum(dtype=wide))


class FiniteFlag:
    """Whether a tensor is all finite, computed on its device without making the host wait.

    On CUDA the 0-dim flag is copied into pinned host memory right behind the work that made the
    tensor, and an event is recorded after the copy: `ready()` polls that event, `value()` waits for
    it only. Reading a device flag directly (`bool(flag)`, `.item()`) would instead wait for every
    kernel queued on the stream so far, the next tower call included, leaving the device idle while
    the host prepares the call after it. Elsewhere the flag is read when asked (the CPU computed it)."""

    def __init__(self, embeddings: torch.Tensor):
        flag = all_finite(embeddings)
        self._event = None
        if flag.device.type == "cuda":
            host = torch.empty((), dtype=torch.bool, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(flag.device))
            flag = host
        self._flag = flag

    def ready(self) -> bool:
        """True once value() would not wait."""
        return self._event is None or self._event.query()

    def wait(self) -> None:
        """Wait for the work behind the flag (the tower call that made the tensor), nothing queued later."""
        if self._event is not None:
            self._event.synchronize()

    def value(self) -> bool:
        self.wait()
        return bool(self._flag)


def finite_flag(embeddings: torch.Tensor) -> FiniteFlag | None:
    """A FiniteFlag for `embeddings` (None when empty): one reduction queued on its device, read
    later (check_finite(..., flag=)) so that the host never stalls the stream between tower calls."""
    return None if embeddings.numel() == 0 else FiniteFlag(embeddings)


def check_finite(embeddings: torch.Tensor, tokens: list[int], strict: bool, *, flag: FiniteFlag | None = None,
                 indices: list[int] | None = None) -> None:
    """Warn (strict: raise NonFiniteOutputError) naming the images whose rows of `embeddings`
    [sum(tokens), out_hidden] hold NaN or infinity. One reduction when all is finite (or none: `flag`
    from finite_flag, read here). indices: how to name the images (default 0..N-1)."""
    if embeddings.numel() == 0 or (flag.value() if flag is not None else bool(all_finite(embeddings))):
        return
    bad_rows = ~torch.isfinite(embeddings).all(dim=-1)
    bad = [i for i, rows in enumerate(bad_rows.split(tokens)) if bool(rows.any())]
    if not bad:  # every value finite; only their sum left float32's range
        return
    if indices is not None:
        bad = [indices[i] for i in bad]
    shown = ", ".join(map(str, bad[:20])) + (" ..." if len(bad) > 20 else "")
    message = (f"non-finite embeddings (NaN or inf) for {len(bad)} of {len(tokens)} image(s) of this call "
               f"(image indices in the call: {shown}); check the checkpoint's weights and the dtype "
               f"(float16 can overflow: try bfloat16 or float32)")
    if strict:
        raise NonFiniteOutputError(message)
    logger.warning("%s", message)


def check_grid(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """grid_thw as int64 on the CPU, checked against pixel_values [P, F] (ValueError naming the shapes)."""
    grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64, device="cpu")
    if grid_thw.dim() != 2 or grid_thw.shape[1] < 3:
        raise ValueError(f"grid_thw must be [N, 3] (t, h, w per image; anyres families add the image size: "
                         f"[N, 5]), got shape {tuple(grid_thw.shape)}")
    if (grid_thw <= 0).any():
        raise ValueError(f"grid_thw entries must be positive, got {grid_thw.tolist()}")
    total = int(grid_thw[:, :3].prod(-1).sum())
    if pixel_values.dim() != 2 or pixel_values.shape[0] != total:
        raise ValueError(f"pixel_values has shape {tuple(pixel_values.shape)}; grid_thw {grid_thw.tolist()} "
                         f"needs [{total}, C*temporal_patch*patch*patch]")
    return grid_thw
