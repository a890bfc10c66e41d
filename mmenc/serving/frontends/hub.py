"""EngineHub: the engine process's side of its front ends. One reader thread per front end turns
its messages into cache lookups and Batcher jobs of the LocalEngine; answers go back from the
batcher's completer thread. Per image the engine unpickles a small header, views the job's patches
in the front end's shared segment, and sends the answer's segment back (an id; a descriptor the
first time): no copy but the batcher's one into the segment.

Messages, front end -> engine: ("job", id, key, grid [t, h, w]) + [patches in a front-end
segment]; ("lookup", id, key): the cache only; ("cancel", id); ("release", segment id): done with
an answer's segment. Engine -> front end: ("info", EngineInfo) once ready (or at once to a front
end that connects later); ("failed", error); ("answer", id, hidden, grid, cached, job segment) +
[embeddings in an engine segment]; ("miss", id, job segment); ("error", id, message, job
segment); ("release", job segment): a job dropped; ("stop",): drain and exit."""
import concurrent.futures
import threading

import torch

from mmenc.logger import init_logger
from mmenc.serving.batcher import Job
from mmenc.serving.engine_client import Encoded, describe
from mmenc.serving.frontends.outputs import Holdings, SharedOutputs
from mmenc.serving.local import LocalEngine
from mmenc.shm import Channel, Segment

logger = init_logger(__name__)


class EngineHub:
    def __init__(self, engine: LocalEngine, outputs: SharedOutputs):
        self.engine, self.outputs = engine, outputs
        self._channels: dict[str, tuple[Channel, Holdings]] = {}
        self._lock = threading.Lock()  # channels, and the ready/failed broadcast vs a new channel

    def attach(self, name: str, channel: Channel) -> threading.Thread:
        """Serve front end `name` on `channel` (in a thread) until it hangs up."""
        holdings = Holdings()
        with self._lock:
            self._channels[name] = (channel, holdings)
            self._greet(channel)
        thread = threading.Thread(target=self._serve, args=(name, channel, holdings), name=f"mmenc-hub-{name}",
                                  daemon=True)
        thread.start()
        return thread

    def ready(self) -> None:
        """The engine is loaded (or failed): tell every front end (those attached later: on attach)."""
        with self._lock:
            for channel, _ in list(self._channels.values()):
                self._greet(channel)

    def stop(self) -> None:
        """Ask every front end to stop accepting, finish its requests and exit."""
        with self._lock:
            channels = [channel for channel, _ in self._channels.values()]
        for channel in channels:
            _send(channel, ("stop",))

    def forget(self, segment: Segment) -> None:
        """An output segment was destroyed: the front ends that mapped it drop it."""
        with self._lock:
            channels = [channel for channel, _ in self._channels.values()]
        for channel in channels:
            channel.forget(segment)

    def _greet(self, channel: Channel) -> None:
        if self.engine.state == "ready":
            _send(channel, ("info", self.engine.info))
        elif self.engine.state == "failed":
            _send(channel, ("failed", self.engine.load_error))

    def _serve(self, name: str, channel: Channel, holdings: Holdings) -> None:
        jobs: dict[int, concurrent.futures.Future] = {}
        try:
            while (message := channel.recv()) is not None:
                header, tensors = message
                kind = header[0]
                if kind == "job":
                    seg_id, patches = tensors[0]
                    self._job(channel, holdings, jobs, header[1], header[2], header[3], patches, seg_id)
                elif kind == "release":
                    if holdings.remove(header[1]):
                        self.outputs.unref(header[1])
                elif kind == "lookup":
                    cached = self.engine.lookup(header[2])
                    encoded = Encoded(cached, True) if cached is not None else None
                    self._answer(channel, holdings, header[1], encoded, None)
                elif kind == "cancel":
                    future = jobs.pop(header[1], None)
                    if future is not None:
                        future.cancel()
                else:
                    logger.error("front end %s sent an unknown message %r; ignored", name, kind)
        except OSError as e:
            logger.error("front end %s: connection failed (%s)", name, e)
        finally:
            with self._lock:
                self._channels.pop(name, None)
            for future in list(jobs.values()):  # nobody is left to read these answers
                future.cancel()
            channel.close()
            for seg_id, count in holdings.drain().items():
                self.outputs.unref(seg_id, count)

    def _job(self, channel: Channel, holdings: Holdings, jobs: dict, rid: int, key: str, grid: list,
             patches: torch.Tensor, seg_id: int) -> None:
        cached = self.engine.lookup(key)
        if cached is not None:
            return self._answer(channel, holdings, rid, Encoded(cached, True), seg_id)
        future = self.engine.submit(key, Job(patches, torch.tensor([grid], dtype=torch.int64)))
        jobs[rid] = future

        def done(f) -> None:  # the batcher's completer thread (or where the job was cancelled)
            jobs.pop(rid, None)
            if f.cancelled():
                return _send(channel, ("release", seg_id))
            if f.exception() is not None:
                return _send(channel, ("error", rid, describe(f.exception()), seg_id))
            self._answer(channel, holdings, rid, f.result(), seg_id)
        future.add_done_callback(done)

    def _answer(self, channel: Channel, holdings: Holdings, rid: int, encoded: Encoded | None,
                seg_id: int | None) -> None:
        if encoded is None:
            return _send(channel, ("miss", rid, seg_id))
        image = encoded.image
        segment = self.outputs.segment_of(image.full)
        assert segment is not None, "the batcher's outputs live in SharedOutputs segments (batcher.alloc)"
        self.outputs.ref(segment)
        holdings.add(segment.id)
        header = ("answer", rid, image.hidden, image.grid_thw, encoded.cached, seg_id)
        if not _send(channel, header, [(segment, image.full)]):
            holdings.remove(segment.id)
            self.outputs.unref(segment.id)


def _send(channel: Channel, header, tensors=()) -> bool:
    try:
        channel.send(header, tensors)
        return True
    except OSError as e:  # the front end is gone: its reader thread sees it and cleans up
        logger.debug("front end gone while sending %s (%s)", header[0], e)
        return False
