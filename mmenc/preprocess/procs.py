"""Worker processes for `Preprocessor(worker_kind="process")`: read, decode, plan (and resize on the
CPU with resize="cpu") outside the calling process, so its thread that launches the tower does not
share the GIL with the decoders (issue 11: with 16 worker threads, host launches took 2.9 s of a
6.1 s stream on the H200 host).

    workers = ProcessWorkers(work, n=16)       # work: an ImageWork (mmenc.preprocess.prepare)
    future = workers.submit(index, "a.jpg")    # -> Ready (pixels in shared memory) or LoadFailure
    ready = future.result(); ...copy ready.pixels away...; ready.release()
    workers.close()

Each worker is `python -m mmenc.preprocess.proc_worker FD` started by subprocess (fork + exec at
once, like multiprocessing's "spawn": nothing of a CUDA parent is inherited, and the user's
`__main__` is not imported again), speaking a mmenc.shm.Channel over a Unix socket pair. The
worker decodes into its own memory and copies the result (one numpy copy, the decoder's [H, W, C]
layout kept) into a shared segment of its SegmentPool; the segment's descriptor crosses once,
after which the parent reuses its mapping. The parent hands the tensor out as `Ready.pixels` (a view
of the segment) and `Ready.release()` gives the segment back once the calling thread has copied it
(into pinned memory on CUDA). Segments are torch's file-descriptor shared memory, unlinked from
/dev/shm as soon as created: nothing is left behind, even if a process is killed.

Workers start as needed (a new one while every running one is busy, up to n), and inputs go to
the worker with the fewest in flight, except a video piece, which goes to the worker that took its
lane's first piece (its decoder goes on there: VideoPiece.lane); one receiver thread turns the answers into the futures'
results. A worker that dies fails the inputs it held (RuntimeError naming
them) and takes no more; the others go on.
"""
import concurrent.futures
import dataclasses
import itertools
import os
import pathlib
import queue
import selectors
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

from PIL import Image

from mmenc.logger import init_logger
from mmenc.preprocess.prepare import ImageWork, Ready
from mmenc.preprocess.video import VideoPiece
from mmenc.shm import NOTHING, Channel, socket_pair

logger = init_logger(__name__)

ENCODED_TYPES = (str, os.PathLike, bytes, bytearray, memoryview)
MAX_LANES = 4096  # video lanes remembered (their worker) at most
KEEP_FREE_BYTES = 32 << 20  # released segments a worker keeps for reuse by default (the rest are destroyed)


def runs_in_process(item: Any) -> bool:
    """Paths and encoded bytes go to the processes: what crosses is a path or the compressed file.
    PIL images and arrays stay in threads: they are already decoded, so pickling one to a process
    copies as many bytes as the work it saves (benchmarks/preprocess_gil.py measures both)."""
    return isinstance(item, ENCODED_TYPES + (VideoPiece,))  # a video piece: its file's path or bytes


@dataclasses.dataclass(eq=False)
class _Worker:
    proc: subprocess.Popen
    channel: Channel
    inflight: dict[int, tuple[concurrent.futures.Future, int, Any]] = dataclasses.field(default_factory=dict)
    alive: bool = True


class ProcessWorkers:
    """n worker processes running `work.prepare`; see the module docstring. Thread safe."""

    def __init__(self, work: ImageWork, n: int, *, stop_timeout_s: float = 10.0, keep_free_bytes: int | None = None):
        """keep_free_bytes: released shared segments each worker keeps for reuse (None: KEEP_FREE_BYTES);
        a segment beyond is destroyed and the parent told to drop its mapping."""
        if n < 1:
            raise ValueError(f"n={n} worker processes; expected >= 1")
        self.n, self.stop_timeout_s = n, stop_timeout_s
        self._work = work
        self._keep_free_bytes = KEEP_FREE_BYTES if keep_free_bytes is None else keep_free_bytes
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._closed = False
        self._lost_one = False  # a worker died: start no more
        self._lent = 0  # segments handed out in a Ready and not released yet
        self._env = dict(os.environ)
        root = str(pathlib.Path(__file__).resolve().parents[2])  # the folder holding this mmenc: workers import it
        self._env["PYTHONPATH"] = os.pathsep.join([root] + ([self._env["PYTHONPATH"]] if self._env.get("PYTHONPATH")
                                                            else []))
        self._workers: list[_Worker] = []
        self._lanes: dict[tuple, _Worker] = {}  # video lanes in progress -> the worker decoding them
        self._started: queue.SimpleQueue = queue.SimpleQueue()  # new workers for the receiver to watch
        self._wake_r, self._wake_w = socket.socketpair()
        self._receiver = threading.Thread(target=self._receive, name="mmenc-preprocess-receiver", daemon=True)
        self._receiver.start()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers]

    @property
    def lent(self) -> int:
        """Shared segments handed out (Ready.pixels) and not released yet: 0 once a consumer is done."""
        with self._lock:
            return self._lent

    def submit(self, index: int, item: Any, resize: str | None = None) -> concurrent.futures.Future:
        """Prepare `item` (a path or encoded bytes) in a worker -> Future of Ready or LoadFailure
        (resize: ImageWork.prepare's)."""
        if isinstance(item, memoryview):
            item = bytes(item)  # a memoryview does not pickle
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("ProcessWorkers is closed; create a new Preprocessor")
            alive = [w for w in self._workers if w.alive]
            lane = item.decoder_key if isinstance(item, VideoPiece) else None
            if lane is not None and (held := self._lanes.get(lane)) is not None and held.alive:
                worker = held  # a video lane's pieces go where its decoder is open
            elif len(self._workers) < self.n and not self._lost_one and all(w.inflight for w in alive):
                worker = self._start_one()  # started as needed: a small call starts few processes
            elif not alive:
                raise RuntimeError(f"all {len(self._workers)} preprocessing worker processes have exited (see the "
                                   f"errors above); use Preprocessor(worker_kind='thread'), or close() the "
                                   f"Preprocessor to start new ones")
            else:
                worker = min(alive, key=lambda w: len(w.inflight))
            if lane is not None:
                if item.lane_last:
                    self._lanes.pop(lane, None)
                else:
                    self._lanes[lane] = worker
                    while len(self._lanes) > MAX_LANES:  # lanes whose last piece never came (a consumer stopped)
                        self._lanes.pop(next(iter(self._lanes)))
            seq = next(self._seq)
            worker.inflight[seq] = (fut, index, item)
        try:
            worker.channel.send(("task", seq, index, item, Image.MAX_IMAGE_PIXELS, resize))
        except OSError as e:  # the worker is gone; the receiver fails what it held
            with self._lock:
                worker.inflight.pop(seq, None)
            fut.set_exception(RuntimeError(f"preprocessing worker process {worker.proc.pid} is gone ({e}); "
                                           f"input #{index} was not prepared"))
        return fut

    def close(self) -> None:
        """Stop the workers (each finishes its current image), wait for them (killing any that do not
        exit within stop_timeout_s), and cancel what was still in flight."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_all()
        self._wake()
        self._receiver.join(timeout=self.stop_timeout_s)
        for w in self._workers:
            for fut, _, _ in w.inflight.values():
                fut.cancel()
            w.inflight.clear()
            w.channel.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- internals ------------------------------------------------------------------------------
    def _start_one(self) -> _Worker:
        """Start a worker (under self._lock) and hand it to the receiver thread."""
        ours, theirs = socket_pair()
        try:
            with theirs:
                proc = subprocess.Popen([sys.executable, "-m", "mmenc.preprocess.proc_worker", str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], env=self._env, stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        worker = _Worker(proc, Channel(ours))
        try:
            worker.channel.send(("init", self._work, self._keep_free_bytes))
        except BaseException:  # e.g. a processor that does not pickle
            proc.kill()
            proc.wait()
            worker.channel.close()
            raise
        self._workers.append(worker)
        self._started.put(worker)
        self._wake()
        return worker

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"w")
        except OSError:
            pass  # closed: the receiver has ended

    def _stop_all(self) -> None:
        for w in self._workers:
            try:
                w.channel.send(("stop",))
            except OSError:
                pass  # already gone
        for w in self._workers:
            try:
                w.proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("preprocessing worker process %d did not stop within %.0f s; killing it",
                               w.proc.pid, self.stop_timeout_s)
                w.proc.kill()
                w.proc.wait()

    def _receive(self) -> None:
        """One thread: every worker's answers -> its futures. Ends after close(), once every worker's
        socket closed."""
        selector = selectors.DefaultSelector()
        selector.register(self._wake_r, selectors.EVENT_READ, None)
        while not (self._closed and len(selector.get_map()) == 1):
            for key, _ in selector.select(timeout=1.0):
                if key.data is None:  # woken: new workers to watch, or closing
                    self._wake_r.recv(4096)
                    while not self._started.empty():
                        w = self._started.get()
                        selector.register(w.channel.sock, selectors.EVENT_READ, w)
                    continue
                worker: _Worker = key.data
                try:  # only what is there: a worker's segment notice alone must not block the others' answers
                    message = worker.channel.recv(wait=False)
                except OSError:
                    message = None
                if message is NOTHING:
                    continue
                if message is None:
                    selector.unregister(worker.channel.sock)
                    self._lost(worker)
                else:
                    self._deliver(worker, *message)
        selector.close()

    def _deliver(self, worker: _Worker, header: tuple, tensors: list) -> None:
        kind, seq = header[0], header[1]
        with self._lock:
            fut, index, item = worker.inflight.pop(seq, (None, -1, None))
        if kind == "ready":
            seg_id, pixels = tensors[0]
            with self._lock:
                self._lent += 1
            release = _Release(worker.channel, seg_id, self._returned)
            if header[3]:  # encoded bytes for nvJPEG: small, copied out now (the decoder reads them later)
                pixels = pixels.clone()
                release()
            result: Any = Ready(index, item, header[2], pixels, encoded=header[3], release=release, resized=header[4])
        else:
            result = header[2]  # LoadFailure, or the exception to raise
        if fut is None:  # close() has given up on it
            fut = concurrent.futures.Future()
            fut.cancel()
        try:
            if kind == "error":
                fut.set_exception(result)
            else:
                fut.set_result(result)
        except concurrent.futures.InvalidStateError:  # cancelled meanwhile (the consumer stopped early)
            if isinstance(result, Ready) and result.release is not None:
                result.release()

    def _returned(self) -> None:
        with self._lock:
            self._lent -= 1

    def _lost(self, worker: _Worker) -> None:
        with self._lock:
            worker.alive = False
            self._lost_one = True
            held = [entry for _, entry in sorted(worker.inflight.items())]
            worker.inflight.clear()
            closing = self._closed
        if closing:  # stopped by close(): what it held is cancelled
            for fut, _, _ in held:
                fut.cancel()
            return
        indices = [index for _, index, _ in held]
        try:
            code = worker.proc.wait(timeout=5.0)  # its socket closed as it died: the exit status follows
        except subprocess.TimeoutExpired:
            code = None
        error = RuntimeError(f"preprocessing worker process {worker.proc.pid} exited (code {code}) while "
                             f"preparing input #{indices[0] if indices else '?'} (inputs it held: {indices}); the "
                             f"other workers go on. A crash of an image decoder on that input is the likely cause")
        logger.error("%s", error)
        for fut, _, _ in held:
            try:
                fut.set_exception(error)
            except concurrent.futures.InvalidStateError:
                pass  # cancelled: the consumer stopped waiting for it


class _Release:
    """Gives one segment back to its worker, once (later calls do nothing)."""

    def __init__(self, channel: Channel, seg_id: int, on_release: Callable[[], None]):
        self._channel, self._seg_id, self._on_release = channel, seg_id, on_release

    def __call__(self) -> None:
        channel, self._channel = self._channel, None
        if channel is None:
            return
        self._on_release()
        try:
            channel.send(("release", self._seg_id))
        except OSError:
            pass  # the worker is gone, and its segments with it
