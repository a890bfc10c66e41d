"""Files mmenc writes (encode outputs, --ec-storage entries, Ray shards): whole or not at all (a
temporary file beside the target, renamed onto it), with the permissions `open()` would give them
under the process umask (0666 & ~umask). safetensors' writer and tempfile.mkstemp create 0600 files,
which another user (a vLLM process reading the encoder cache) could not read."""
import os
import pathlib
from collections.abc import Callable

_DEFAULT_MODE = 0o666


def current_umask() -> int:
    """This process's umask, read without changing it (Linux: /proc/self/status; elsewhere a
    set-and-restore of os.umask, which briefly changes it for every thread)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode a new regular file gets here: 0666 & ~umask (0644 under the usual 022)."""
    return _DEFAULT_MODE & ~current_umask()


def write_atomically(path: str | os.PathLike, write: Callable[[str], None], tmp: str | os.PathLike | None = None) -> None:
    """`write(tmp)` to a temporary file beside `path` (default: .<name>.<pid>.tmp), give it the umask's
    mode, then rename it onto `path`: a reader never sees a half-written file, an interruption leaves
    any earlier `path` as it was."""
    path = pathlib.Path(path)
    tmp = pathlib.Path(tmp) if tmp is not None else path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(str(tmp))
        os.chmod(tmp, file_mode())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
