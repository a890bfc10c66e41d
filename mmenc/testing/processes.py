"""Helpers for tests and benchmarks that start servers on loopback: a free port, and other processes'
state read from Linux's /proc (children by parent, CPU seconds by process or session)."""
import os
import socket
from collections.abc import Iterator


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command (state, ppid, pgrp, session, ...; utime and stime are
    [11] and [12], in clock ticks), or None for a process that is gone (or no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def processes() -> Iterator[tuple[int, list[str]]]:
    """(pid, stat_fields(pid)) of every live process (none without /proc)."""
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            fields = stat_fields(entry)
            if fields is not None:
                yield int(entry), fields


def child_pids(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is `pid`, sorted."""
    return sorted(child for child, fields in processes() if int(fields[1]) == pid and fields[0] != "Z")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (nan when it is gone or there is no /proc)."""
    fields = stat_fields(pid)
    return float("nan") if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def session_cpu_s(sid: int) -> float:
    """User + system CPU seconds of every live process in session `sid` (a server and its children)."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(fields[11]) + int(fields[12])) / tick for _, fields in processes() if int(fields[3]) == sid)
