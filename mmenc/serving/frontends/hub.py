"""EngineHub: the engine process's side of its front ends. One reader thread per front end turns
its messages into cache lookups and Batcher jobs of the LocalEngine; answers go back from the
batcher's completer thread. Per image the engine only unpickles a small header, maps the job's
shared patches, and sends the answer's shared embeddings back (a file descriptor, no copy).

Messages, front end -> engine: ("job", id, key, grid [t, h, w]) + [pixel_values];
("lookup", id, key): the cache only; ("cancel", id).
Engine -> front end: ("info", EngineInfo) once ready (or at once to a front end that connects
later); ("failed", error); ("answer", id, hidden, grid, cached) + [embeddings]; ("miss", id);
("error", id, message): the tower call failed; ("stop",): drain and exit."""
import concurrent.futures
import threading
from collections.abc import Callable

import torch

from mmenc.logger import init_logger
from mmenc.serving.batcher import Job
from mmenc.serving.frontends.client import Encoded, describe
from mmenc.serving.frontends.transport import Channel
from mmenc.serving.local import LocalEngine

logger = init_logger(__name__)


class EngineHub:
    def __init__(self, engine: LocalEngine):
        self.engine = engine
        self._channels: dict[str, Channel] = {}
        self._lock = threading.Lock()  # channels, and the ready/failed broadcast vs a new channel

    def attach(self, name: str, channel: Channel, on_lost: Callable[[str], None]) -> threading.Thread:
        """Serve front end `name` on `channel` (in a thread); on_lost(name) when it hangs up."""
        with self._lock:
            self._channels[name] = channel
            self._greet(channel)
        thread = threading.Thread(target=self._serve, args=(name, channel, on_lost), name=f"mmenc-hub-{name}",
                                  daemon=True)
        thread.start()
        return thread

    def ready(self) -> None:
        """The engine is loaded: tell every front end (those attached later are told on attach)."""
        with self._lock:
            for channel in list(self._channels.values()):
                self._greet(channel)

    def failed(self) -> None:
        self.ready()  # _greet sends the failure

    def stop(self) -> None:
        """Ask every front end to stop accepting, finish its requests and exit."""
        with self._lock:
            channels = list(self._channels.values())
        for channel in channels:
            _send(channel, ("stop",))

    def _greet(self, channel: Channel) -> None:
        if self.engine.state == "ready":
            _send(channel, ("info", self.engine.info))
        elif self.engine.state == "failed":
            _send(channel, ("failed", self.engine.load_error))

    def _serve(self, name: str, channel: Channel, on_lost: Callable[[str], None]) -> None:
        jobs: dict[int, concurrent.futures.Future] = {}
        try:
            while (message := channel.recv()) is not None:
                header, tensors = message
                kind, rid = header[0], header[1]
                if kind == "job":
                    self._job(channel, jobs, rid, header[2], header[3], tensors[0])
                elif kind == "lookup":
                    cached = self.engine.lookup(header[2])
                    _answer(channel, rid, Encoded(cached, True) if cached is not None else None)
                elif kind == "cancel":
                    future = jobs.pop(rid, None)
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
            on_lost(name)

    def _job(self, channel: Channel, jobs: dict, rid: int, key: str, grid: list, pixel_values: torch.Tensor) -> None:
        cached = self.engine.lookup(key)
        if cached is not None:
            return _answer(channel, rid, Encoded(cached, True))
        future = self.engine.submit(key, Job(pixel_values, torch.tensor([grid], dtype=torch.int64)))
        jobs[rid] = future

        def done(f) -> None:  # the batcher's completer thread
            jobs.pop(rid, None)
            if f.cancelled():
                return
            if f.exception() is not None:
                return _send(channel, ("error", rid, describe(f.exception())))
            _answer(channel, rid, f.result())
        future.add_done_callback(done)


def _answer(channel: Channel, rid: int, encoded: Encoded | None) -> None:
    if encoded is None:
        return _send(channel, ("miss", rid))
    image = encoded.image
    _send(channel, ("answer", rid, image.hidden, image.grid_thw, encoded.cached), [image.full])


def _send(channel: Channel, header, tensors=()) -> None:
    try:
        channel.send(header, tensors)
    except OSError as e:  # the front end is gone: its reader thread sees it and cleans up
        logger.debug("front end gone while sending %s (%s)", header[0], e)
