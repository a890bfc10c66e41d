"""EngineClient: what the HTTP side of the service needs from whatever runs the tower.

EncodeService (routes, parsing, preprocessing, rendering) talks to the tower only through this
interface. Implementations: LocalEngine (the Encoder in this process: `mmenc serve`, a Ray Serve
replica), ProcessEngineClient (a front-end process talking to the engine process over shared
memory: `mmenc serve --frontends N`); a client of Ray Serve replicas can be a third."""
import abc
import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

import torch

from mmenc.serving.batcher import Job
from mmenc.serving.formats import EncodedImage


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What a front end needs once the engine is loaded and warmed. card: the /v1/models entry;
    identity: model + processor + dtype, for content keys (cache.content_key); processor: the
    Encoder's image processor (front ends preprocess); uint8: jobs carry uint8 patches (normalized
    by the engine on the device), else float pixel_values cast to `dtype`."""

    model_name: str
    card: dict
    identity: bytes
    processor: object
    uint8: bool
    dtype: torch.dtype
    video_processor: object = None  # the Encoder's (mmenc.serving.video), None: the model takes no video
    pooled_dim: int | None = None  # width of the pooled image embedding (Encoder.pooled_dim); None: no pooling head
    text_error: str | None = "the checkpoint has no text tower"  # why texts cannot be embedded; None: they can
    matryoshka: tuple[int, ...] | bool = ()  # config.json's matryoshka dimensions (True: any); (): fixed width
    vllm_grid: bool = True  # the `vllm` format's image part carries the grid (mmenc.vllm_inputs.takes_grid)


@dataclasses.dataclass(frozen=True)
class Encoded:
    """One image's answer: its embeddings, and whether the encoder cache gave them."""

    image: EncodedImage
    cached: bool


class EngineClient(abc.ABC):
    """state: "loading" until `info` is set ("ready"); "failed" (load_error says why) or "stopped".
    Thread safe: lookup and submit are called from the service's pool threads."""

    state: str = "loading"
    load_error: str | None = None
    info: EngineInfo | None = None

    @abc.abstractmethod
    def start(self, on_failure: Callable[[], None] | None = None) -> threading.Thread | None:
        """Begin loading / connecting (idempotent); on_failure() runs if the engine cannot serve."""

    @abc.abstractmethod
    def lookup(self, key: str) -> EncodedImage | None:
        """The cached embeddings of `key` when this client can tell cheaply (counting a hit or a
        miss), else None: `submit` then checks the cache where it lives."""

    @abc.abstractmethod
    def submit(self, key: str, job: Job | None) -> concurrent.futures.Future:
        """Future[Encoded] of `job` (pixel_values, grid_thw; its own future is not used), answered from
        the cache when `key` is there. job=None: the cache only, Future[Encoded | None]. Cancelling
        the future drops the job if its tower call has not started; a tower failure is its exception."""

    def submit_text(self, key: str, text: str) -> concurrent.futures.Future:
        """Future[Encoded] of one text's embedding (EncodedImage [1, dim], grid (1, 1, tokens)), answered
        from the cache when `key` is there (only when info.text_error is None)."""
        raise NotImplementedError(f"{type(self).__name__} does not embed texts")

    @abc.abstractmethod
    def close(self, timeout: float | None = None) -> None:
        """Stop (after the requests in flight were answered), waiting at most `timeout` seconds for
        work in this process (None: the engine's default)."""

    def loading(self) -> bool:
        """Whether a load still runs in this process (see LocalEngine)."""
        return False

    def busy(self) -> bool:
        """Whether a thread of this engine still runs torch after close() (see LocalEngine)."""
        return self.loading()


class RemoteError(RuntimeError):
    """An exception raised where the tower runs (another process), carried by its description."""


def describe(error: BaseException) -> str:
    """'TypeName: message' of an exception, the same whether it was raised here or in the engine."""
    return str(error) if isinstance(error, RemoteError) else f"{type(error).__name__}: {error}"


def done_future(value) -> concurrent.futures.Future:
    future = concurrent.futures.Future()
    future.set_result(value)
    return future


def settle(future: concurrent.futures.Future, *, result=None, error: BaseException | None = None) -> None:
    """Set a future that its owner may have cancelled meanwhile (then there is nothing to do)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
