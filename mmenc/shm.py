"""Shared memory between processes of one machine: reusable segments and the Channel that sends
tensors living in them. Used by `mmenc serve --frontends N` (engine <-> front ends,
mmenc.serving.frontends) and by the preprocessing worker processes (mmenc.preprocess.procs).

A Segment is a shared-memory block (torch's file-descriptor sharing) of a power-of-two size. Its
owner takes it from a SegmentPool, writes a tensor into it, and sends it over a Channel: the first
time a segment goes to a given peer its file descriptor travels with the message (SCM_RIGHTS) and
the peer maps it; afterwards only its id does, and the peer reuses its mapping. Reusing mapped
segments is what makes this cheap: a fresh shared block costs its page faults on both sides
(measured ~5 ms of CPU for a 1.8 MB answer on the 2-core machine, against ~0.5 ms for a copy into
memory already mapped; docs/serving.md, "Front ends"). When the peer is done with a tensor it
says so (a "release" message of the protocol above this module); the owner gives the segment
back to its pool, which keeps up to `max_free_bytes` for reuse and destroys the rest, telling
the peers that mapped one to forget it (handled inside Channel.recv)."""
import dataclasses
import itertools
import os
import pickle
import resource
import socket
import threading

import torch

from mmenc.logger import init_logger

logger = init_logger(__name__)

_PACKET = 1 << 16  # header bytes per packet; a longer header goes in several (CONTINUED first)
_CONTINUED, _LAST = b"C", b"L"
_MAX_FDS = 250  # under the kernel's SCM_MAX_FD (253)
_MIN_SEGMENT = 1 << 16
_FORGET = "__forget__"
NOTHING = ("__nothing__", [])  # Channel.recv(wait=False) after a message of the channel's own


@dataclasses.dataclass(eq=False)
class Segment:
    id: int
    storage: torch.UntypedStorage
    fd: int  # the storage's own descriptor (closed with it)
    refs: int = 0  # users of the segment, for owners that share it (see EngineHub)

    def tensor(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor at the start of the segment (it must fit)."""
        return torch.empty(0, dtype=dtype).set_(self.storage, 0, shape)


class SegmentPool:
    """Segments by size class (powers of two from 64 KiB), reused once given back. Thread safe."""

    _ids = itertools.count(1)  # segment ids unique within the process

    def __init__(self, max_free_bytes: int = 256 << 20):
        self.max_free_bytes = max_free_bytes
        self._free: dict[int, list[Segment]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Segment:
        size = max(_MIN_SEGMENT, 1 << max(0, nbytes - 1).bit_length())
        with self._lock:
            free = self._free.get(size)
            if free:
                self._free_bytes -= size
                return free.pop()
        storage = torch.UntypedStorage._new_shared(size)
        fd, _ = storage._share_fd_cpu_()
        return Segment(next(self._ids), storage, fd)

    def give_back(self, segment: Segment) -> bool:
        """Keep `segment` for reuse (True) or drop it, over max_free_bytes (False: tell its peers)."""
        size = segment.storage.nbytes()
        with self._lock:
            if self._free_bytes + size <= self.max_free_bytes:
                self._free.setdefault(size, []).append(segment)
                self._free_bytes += size
                return True
        return False


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard one (every segment holds a
    descriptor in its owner and in each peer that mapped it); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d (%s)", soft, hard, e)
    return soft


def socket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


class Channel:
    """send(header, [(segment, tensor in it), ...]) from any thread (one message at a time);
    recv() -> (header, [(segment id, tensor), ...]) from one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()
        self._known: set[int] = set()  # our segments the peer has mapped
        self._mapped: dict[int, torch.UntypedStorage] = {}  # the peer's segments mapped here

    def send(self, header, tensors=()) -> None:
        """Raises OSError when the peer is gone."""
        with self._send_lock:
            fds, layouts = [], []
            for segment, t in tensors:
                fresh = segment.id not in self._known
                if fresh:
                    fds.append(segment.fd)
                    self._known.add(segment.id)
                layouts.append((segment.id, segment.storage.nbytes() if fresh else 0, t.dtype, tuple(t.shape),
                                t.stride(), t.storage_offset()))
            if len(fds) > _MAX_FDS:
                raise ValueError(f"{len(fds)} new segments in one message; at most {_MAX_FDS}")
            data = pickle.dumps((header, layouts), protocol=pickle.HIGHEST_PROTOCOL)
            while len(data) > _PACKET:
                self.sock.sendall(_CONTINUED + data[:_PACKET])
                data = data[_PACKET:]
            socket.send_fds(self.sock, [_LAST + data], fds)

    def forget(self, segment: Segment) -> None:
        """`segment` is destroyed: the peer drops its mapping (if it has one)."""
        with self._send_lock:
            if segment.id not in self._known:
                return
            self._known.discard(segment.id)
        try:
            self.send((_FORGET, segment.id))
        except OSError:
            pass

    def return_segment(self, pool: SegmentPool, segment: Segment) -> None:
        """The peer is done with our `segment`: back into `pool` for reuse, or, when the pool drops
        it, the peer forgets its mapping too."""
        if not pool.give_back(segment):
            self.forget(segment)

    def recv(self, wait: bool = True):
        """(header, [(segment id, tensor), ...]), or None once the peer has closed its end. The channel's
        own messages (the peer destroyed a segment: forget its mapping) are handled here; after one,
        wait=False returns NOTHING instead of blocking for the next message: a caller that selects over
        several channels must read only what is there (blocking here starved every other channel)."""
        while True:
            message = self._recv_one()
            if message is None or message[0][0] != _FORGET:
                return message
            self._mapped.pop(message[0][1], None)
            if not wait:
                return NOTHING

    def _recv_one(self):
        parts, fds = [], []
        while True:
            data, got, flags, _ = socket.recv_fds(self.sock, _PACKET + 1, _MAX_FDS)
            fds += got
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                for fd in fds:
                    os.close(fd)
                raise OSError(f"a channel message was truncated (flags {flags:#x}); the peer is not a mmenc Channel")
            parts.append(data[1:])
            if data[:1] == _LAST:
                break
        header, layouts = pickle.loads(b"".join(parts))
        fds.reverse()
        tensors = []
        for seg_id, size, dtype, shape, stride, offset in layouts:
            if size:  # a segment new to us: map it (torch dups the descriptor)
                fd = fds.pop()
                try:
                    self._mapped[seg_id] = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
                finally:
                    os.close(fd)
            storage = self._mapped[seg_id]
            tensors.append((seg_id, torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)))
        return header, tensors

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._mapped.clear()
