"""glibc's malloc in a process that runs a tower on the CPU: keep freed blocks for the next call.

A CPU tower call allocates activations of tens of MiB per op (Qwen2.5-VL-7B on 1 x 1036 px: [5476, 3420]
bf16 is 37 MiB). glibc maps a block above its mmap threshold (dynamic, at most 32 MiB) afresh and unmaps it
on free, and gives the heap's top back to the kernel above its trim threshold, so every call faults in and
zeroes the same pages again: measured on the 2-core EPYC (BENCHMARKS.md, "glibc's malloc keeping freed
blocks"), that tower cut to 4 blocks took 263,000-343,000 minor faults and 0.50-0.64 s of system time per
5.1-5.5 s call.

`keep_freed_blocks()` sets M_MMAP_THRESHOLD to 1 GiB (larger blocks are still mapped), M_TRIM_THRESHOLD to
2 GiB (the heap keeps up to that much free at its top) and M_TOP_PAD to 64 MiB, process-wide, once: the
faults fell to about none, the call's CPU time by 8-12%, and the process keeps about one peak more of heap
(resident memory +0.3-0.4 GiB, flat from the 42nd of 96 calls of six shapes). The CPU platform does it when an Encoder puts its tower on the
CPU, unless `cpu_malloc="system"` (EncoderSettings, `--cpu-malloc system`). Not glibc (musl, macOS): nothing.
"""
import ctypes
import ctypes.util
import threading

from mmenc.logger import init_logger

logger = init_logger(__name__)

# glibc's <malloc.h>
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
TUNING = {"mmap threshold": (_M_MMAP_THRESHOLD, 1 << 30), "trim threshold": (_M_TRIM_THRESHOLD, (1 << 31) - 1),
          "top pad": (_M_TOP_PAD, 1 << 26)}  # mallopt takes a C int: 2 GiB - 1 at most

_lock = threading.Lock()
_done: str | None = None


def _glibc():
    """glibc's mallopt, or None where the C library is not glibc."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return libc


def keep_freed_blocks() -> str:
    """Tune glibc's malloc as the module docstring says (once per process; later calls return the first
    one's line). Returns what was done, for the log: the settings, or why nothing was."""
    global _done
    with _lock:
        if _done is None:
            libc = _glibc()
            if libc is None:
                _done = "host malloc: not glibc, left as it is"
            else:
                refused = [name for name, (option, value) in TUNING.items() if not libc.mallopt(option, value)]
                kept = ", ".join(f"{name} {_size(value)}" for name, (_, value) in TUNING.items() if name not in refused)
                _done = f"host malloc: glibc keeps freed blocks ({kept})" + (
                    f"; refused: {', '.join(refused)}" if refused else "")
            logger.info("%s (cpu_malloc='system' leaves it)", _done)
        return _done


def _size(value: int) -> str:
    return f"{(value + 1) >> 30} GiB" if value >= 1 << 30 else f"{value >> 20} MiB"
