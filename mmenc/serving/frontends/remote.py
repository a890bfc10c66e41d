"""ProcessEngineClient: a front end's EngineClient, talking to the engine process over a Channel
(messages in mmenc/serving/frontends/hub.py). A job's patches are copied into one of this front
end's pooled shared segments (given back when the engine releases it); an answer's embeddings are
a view of the engine's segment, released to the engine when the tensor is gone. The cache lives
in the engine, so `lookup` leaves it to `submit`."""
import concurrent.futures
import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from mmenc.logger import init_logger
from mmenc.serving.batcher import Job
from mmenc.serving.engine_client import EngineClient, Encoded, RemoteError, settle
from mmenc.serving.formats import EncodedImage
from mmenc.shm import Channel, Segment, SegmentPool

logger = init_logger(__name__)


class EngineGone(RuntimeError):
    """The engine process exited or closed the connection."""


class ProcessEngineClient(EngineClient):
    def __init__(self, channel: Channel, on_stop: Callable[[], None], pool: SegmentPool | None = None):
        """on_stop(): the engine asked this front end to stop, or is gone (the server should exit)."""
        self.channel, self._on_stop = channel, on_stop
        self.pool = pool or SegmentPool()
        self.state, self.load_error, self.info = "loading", None, None
        self._futures: dict[int, concurrent.futures.Future] = {}
        self._lent: dict[int, Segment] = {}  # our segments holding jobs the engine has not released
        self._ids = itertools.count()
        self._reader: threading.Thread | None = None
        self._on_failure: Callable[[], None] | None = None
        self._closed = False
        self.engine_gone = False  # the engine process exited without stopping this front end

    def start(self, on_failure: Callable[[], None] | None = None) -> threading.Thread:
        if self._reader is None:
            self._on_failure = on_failure
            self._reader = threading.Thread(target=self._read, name="mmenc-engine-reader", daemon=True)
            self._reader.start()
        return self._reader

    def lookup(self, key: str) -> EncodedImage | None:
        return None  # the engine looks when the job arrives

    def submit(self, key: str, job: Job | None) -> concurrent.futures.Future:
        def send(rid: int) -> None:
            if job is None:
                self.channel.send(("lookup", rid, key))
                return
            pixels = job.pixel_values
            segment = self.pool.take(pixels.numel() * pixels.element_size())
            shared = segment.tensor(tuple(pixels.shape), pixels.dtype).copy_(pixels)
            self._lent[segment.id] = segment
            kind = "pooled" if job.pooled else "job"
            self.channel.send((kind, rid, key, job.grid_thw[0].tolist()), [(segment, shared)])

        return self._request(send)

    def submit_text(self, key: str, text: str) -> concurrent.futures.Future:
        return self._request(lambda rid: self.channel.send(("text", rid, key, text)))

    def _request(self, send: Callable[[int], None]) -> concurrent.futures.Future:
        """A new request id and its future; send(rid) puts the request on the channel. A gone engine settles
        the future with EngineGone; cancelling the future tells the engine."""
        rid, future = next(self._ids), concurrent.futures.Future()
        self._futures[rid] = future
        try:
            send(rid)
        except OSError as e:
            self._futures.pop(rid, None)
            settle(future, error=EngineGone(f"the engine process is gone ({e})"))
            return future
        future.add_done_callback(lambda f: f.cancelled() and self._cancel(rid))
        return future

    def _cancel(self, rid: int) -> None:
        if self._futures.pop(rid, None) is not None:
            self._send(("cancel", rid))

    def close(self, timeout: float | None = None) -> None:
        self._closed = True
        self.channel.close()

    def _send(self, header) -> None:
        try:
            self.channel.send(header)
        except OSError:
            pass  # the engine is gone: the reader sees it

    def _read(self) -> None:
        try:
            while True:
                message = self.channel.recv()
                if message is None:
                    break
                self._handle(*message)
                del message  # an answer's tensor is released when its request is done with it, not later
        except OSError as e:
            if not self._closed:
                logger.error("front end: the connection to the engine failed (%s)", e)
        if self._closed:
            return
        logger.error("front end: the engine process is gone; answering 503 and exiting")
        self.state, self.load_error, self.engine_gone = "failed", "the engine process exited", True
        for rid in list(self._futures):
            future = self._futures.pop(rid, None)
            if future is not None:
                settle(future, error=EngineGone("the engine process exited before answering"))
        self._on_stop()

    def _give_back(self, seg_id: int | None) -> None:
        segment = self._lent.pop(seg_id, None) if seg_id is not None else None
        if segment is not None:
            self.channel.return_segment(self.pool, segment)

    def _handle(self, header: tuple, tensors: list) -> None:
        kind = header[0]
        if kind == "answer":
            _, rid, hidden, grid, cached, job_segment = header
            self._give_back(job_segment)
            seg_id, full = tensors[0]
            weakref.finalize(full, self._send, ("release", seg_id))  # the engine may reuse it once this is gone
            future = self._futures.pop(rid, None)
            if future is not None:
                settle(future, result=Encoded(EncodedImage(full, hidden, tuple(grid)), cached))
        elif kind == "vector":
            _, rid, hidden, grid, cached, job_segment, raw, dtype, shape = header
            self._give_back(job_segment)
            full = torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape)
            future = self._futures.pop(rid, None)
            if future is not None:
                settle(future, result=Encoded(EncodedImage(full, hidden, tuple(grid)), cached))
        elif kind in ("miss", "error"):
            self._give_back(header[-1])
            future = self._futures.pop(header[1], None)
            if future is not None:
                settle(future, result=None) if kind == "miss" else settle(future, error=RemoteError(header[2]))
        elif kind == "release":
            self._give_back(header[1])
        elif kind == "info":
            self.info, self.state = header[1], "ready"
        elif kind == "failed":
            self.state, self.load_error = "failed", header[1]
            if self._on_failure is not None:
                self._on_failure()
        elif kind == "stop":
            self._on_stop()
        else:
            logger.error("front end: unknown message %r from the engine; ignored", kind)
