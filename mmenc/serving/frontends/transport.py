"""Channel: one front end <-> engine connection, an AF_UNIX SOCK_SEQPACKET socket pair. A message is
a pickled header plus CPU tensors; each tensor's storage travels as a shared-memory file descriptor
(SCM_RIGHTS), so its bytes are never copied through the socket: the receiver maps the same pages.
A storage already in shared memory (`shared_empty`, or one sent before) is sent as it is; another
is moved into shared memory first (one copy, in the sender).

Every shared storage keeps its file descriptor open while it lives (torch's "file_descriptor"
sharing): the engine holds one per queued job and per cache entry (`raise_fd_limit`)."""
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


def shared_empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor in shared memory (sent by a Channel without a copy)."""
    numel = 1
    for n in shape:
        numel *= n
    storage = torch.UntypedStorage._new_shared(max(1, numel) * torch.empty((), dtype=dtype).element_size())
    return torch.empty(0, dtype=dtype).set_(storage, 0, shape)


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to the hard one (each shared tensor holds a
    descriptor); returns the limit now in force."""
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
    """send(header, tensors) from any thread (one message at a time); recv() from one thread."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, header, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor] = ()) -> None:
        """Raises OSError when the other side is gone."""
        if len(tensors) > _MAX_FDS:
            raise ValueError(f"{len(tensors)} tensors in one message; at most {_MAX_FDS}")
        fds, layouts = [], []
        for t in tensors:
            storage = t.untyped_storage()
            fd, size = storage._share_fd_cpu_()  # no copy when the storage is shared already
            fds.append(fd)
            layouts.append((size, t.dtype, tuple(t.shape), t.stride(), t.storage_offset()))
        data = pickle.dumps((header, layouts), protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            while len(data) > _PACKET:
                self.sock.sendall(_CONTINUED + data[:_PACKET])
                data = data[_PACKET:]
            socket.send_fds(self.sock, [_LAST + data], fds)

    def recv(self):
        """(header, [tensor, ...]), or None once the other side has closed its end."""
        parts = []
        while True:
            data, fds, flags, _ = socket.recv_fds(self.sock, _PACKET + 1, _MAX_FDS)
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
        tensors = []
        for fd, (size, dtype, shape, stride, offset) in zip(fds, layouts):
            try:
                storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # maps the pages (dups the fd)
            finally:
                os.close(fd)
            tensors.append(torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride))
        return header, tensors

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
