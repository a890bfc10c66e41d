"""EncodeService: the Encoder behind the HTTP routes. Loads and warms the tower (in a thread, so
/health can answer 503 meanwhile), admits requests against the queue bound, preprocesses each
image in a thread pool beside the tower, answers repeats from the encoder cache, sends the rest
through the one Batcher, and renders the response items."""
import asyncio
import concurrent.futures
import dataclasses
import io
import threading
import time
from collections.abc import Callable

from mmenc.logger import init_logger
from mmenc.serving.batcher import Batcher, Job
from mmenc.serving.launch import make_batcher
from mmenc.serving.cache import EncoderCache, content_key, model_identity
from mmenc.serving.ec_storage import ECStorage
from mmenc.serving.formats import Body, EncodedImage, dtype_name, dumps, render_item
from mmenc.serving.inputs import EncodeRequest, ImageInput, ItemError, RequestError
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.pending import Pending
from mmenc.serving.preprocess import preprocess_image
from mmenc.serving.settings import ServeSettings
from mmenc.serving.tensor_bytes import TensorSaver

logger = init_logger(__name__)


@dataclasses.dataclass
class _Item:
    """One image on its way through the service."""

    key: str | None = None
    image: EncodedImage | None = None
    error: ItemError | None = None
    hit: bool = False


class EncodeService:
    def __init__(self, settings: ServeSettings, make_encoder: Callable[[], object], metrics: ServeMetrics, *,
                 batcher_factory: Callable[..., Batcher] = make_batcher):
        """batcher_factory(encoder, settings, metrics) -> the Batcher, once the encoder is loaded
        (default: launch.make_batcher; benchmarks/serve_stand_in.py passes a stand-in tower's)."""
        self.settings, self.metrics = settings, metrics
        self._make_encoder, self._batcher_factory = make_encoder, batcher_factory
        self.state, self.load_error = "loading", None
        self.encoder = self.batcher = None
        self.card: dict = {}
        self.cache = EncoderCache(settings.cache_bytes)
        self.ec = ECStorage(settings.ec_storage) if settings.ec_storage else None
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="mmenc-cpu")
        self.identity = b""  # model + processor + dtype, for content keys (set once loaded)
        self._in_flight = 0  # touched on the event loop only
        self.saver = TensorSaver()  # torch.save bytes from per-shape templates (formats.torch_b64)
        self._uint8 = False  # jobs carry uint8 patches, normalized on the device by the batcher
        self._loader: threading.Thread | None = None
        self._closing = threading.Event()  # set by close(): a load still running stops at its next step

    # -- life cycle --------------------------------------------------------------------------------
    def start_loading(self, on_failure: Callable[[], None] | None = None) -> threading.Thread:
        """Load the encoder in a thread (once: a second call returns the first call's thread, so a
        host that loads before serving, like a Ray Serve replica, can join it first)."""
        if self._loader is not None:
            return self._loader

        def load():
            try:
                self._load()
            except Exception as e:  # noqa: BLE001 - reported through /health and the log, then the server stops
                logger.exception("loading the encoder failed")
                self.state, self.load_error = "failed", f"{type(e).__name__}: {e}"
                if on_failure is not None:
                    on_failure()
        self._loader = threading.Thread(target=load, name="mmenc-load", daemon=True)
        self._loader.start()
        return self._loader

    def _load(self) -> None:
        start = time.perf_counter()
        enc = self.encoder = self._make_encoder()
        if self._closing.is_set():  # stopped while loading: close() closes the encoder
            return
        warm = _warmup_image()
        pixel_values, grid = enc.preprocess([warm])
        out = enc.encode_pixels(pixel_values, grid, return_extras=True)
        hidden, levels = out.embeddings.shape[1], len(out.extras.get("deepstack") or [])
        loaded = enc.loaded
        archs = (getattr(loaded, "hf_config", None) or {}).get("architectures") or [type(loaded.config).__name__]
        self.card = {"id": enc.model_name, "object": "model", "architecture": archs[0], "hidden_size": hidden,
                     "image_embeds_size": hidden * (1 + levels), "deepstack_levels": levels,
                     "dtype": dtype_name(loaded.dtype)}
        self.identity = model_identity(enc.model_name, enc.processor, loaded.dtype)
        if self._closing.is_set():
            return
        self.batcher = self._batcher_factory(enc, self.settings, self.metrics)
        self._uint8 = self.batcher.prepare is not None
        self.state = "ready"
        logger.info("encoder %s ready in %.1f s (%s)", enc.model_name, time.perf_counter() - start, self.card)

    def loading(self) -> bool:
        """Whether the loader thread still runs (e.g. after close() gave up waiting for it)."""
        return self._loader is not None and self._loader.is_alive()

    def close(self) -> None:
        """Stop: a load in progress stops at its next step (waited for up to shutdown_timeout_s; if it
        is still running then, it is left to the process exit, see server.serve), then the batcher
        finishes its queued jobs, the pool stops and the Encoder is closed."""
        self._closing.set()
        if self.loading():
            logger.info("stopping while the encoder loads: waiting up to %.0f s for the load to stop",
                        self.settings.shutdown_timeout_s)
            self._loader.join(self.settings.shutdown_timeout_s)
            if self.loading():
                logger.warning("the encoder is still loading after %.0f s (shutdown_timeout_s); not waiting longer",
                               self.settings.shutdown_timeout_s)
                self.pool.shutdown(wait=True, cancel_futures=True)
                return
        if self.state == "loading":
            self.state = "stopped"
        if self.batcher is not None:
            self.batcher.close(timeout=self.settings.shutdown_timeout_s)
        self.pool.shutdown(wait=True, cancel_futures=True)
        if self.encoder is not None:
            self.encoder.close()

    # -- one request -------------------------------------------------------------------------------
    async def encode(self, request: EncodeRequest) -> list[bytes]:
        """The JSON response body, in pieces (formats.Body): {"model": ..., "data": [item per image,
        input order], "usage": ...}. The event loop hands the request to the pool once and wakes once
        for the answer: pool threads prepare the images and submit them to the batcher, the last
        result submits the rendering, which sets the answer (pending.Pending)."""
        if self.state != "ready":
            raise RequestError(503, "model", f"the encoder is {self.state}"
                               + (f" ({self.load_error})" if self.load_error else "; retry shortly"), kind="not_ready")
        n = len(request.images)
        limit = self.settings.max_queue_images
        if self._in_flight + n > limit:
            raise RequestError(503, "images", f"queue full: {self._in_flight} images in flight, {n} more would exceed "
                                              f"max_queue_images={limit}; retry later", kind="queue_full")
        self._in_flight += n
        self.metrics.in_flight.set(self._in_flight)
        pending = Pending(n, lambda items: self._render(request, items))
        try:
            self.pool.submit(pending.guard, self._start, pending, request.images)
            return await asyncio.wrap_future(pending.answer)
        except asyncio.CancelledError:  # the client left: its jobs not yet in a tower call are dropped
            self.metrics.cancelled.inc(pending.cancel())
            raise
        finally:
            self._in_flight -= n
            self.metrics.in_flight.set(self._in_flight)

    def _start(self, pending: Pending, images: list[ImageInput]) -> None:
        """In a pool thread: the request's first image here, each other one in its own pool task."""
        for image in images[1:]:
            self.pool.submit(pending.guard, self._image, pending, image)
        self._image(pending, images[0])

    def _image(self, pending: Pending, image: ImageInput) -> None:
        if image.error is not None:
            return pending.settle(image.index, _Item(error=image.error), self.pool)
        if pending.answer.done():  # cancelled: nothing more to do
            return
        item, job = self._prepare(image)
        if job is None:
            return pending.settle(image.index, item, self.pool)

        def tower_done(future) -> None:  # in the batcher's completer thread: cheap steps only
            if future.cancelled():
                return
            if future.exception() is not None:  # the tower failed for this batch: an item error, not a 500
                e = future.exception()
                failed = _Item(error=ItemError("encoder_error", f"images[{image.index}]: the tower failed "
                                                                f"({type(e).__name__}: {e})"))
                return pending.settle(image.index, failed, self.pool)
            item.image = future.result()
            self.cache.put(item.key, item.image)
            pending.settle(image.index, item, self.pool)

        pending.track(self.batcher.submit(job)).add_done_callback(tower_done)

    def _prepare(self, image: ImageInput) -> tuple[_Item, Job | None]:
        """In a pool thread: key, cache lookup, then (on a miss) decode + preprocess."""
        key = image.uuid or content_key(self.identity, image.data)
        cached = self.cache.get(key)
        if cached is not None:
            self.metrics.cache_hits.inc()
            return _Item(key=key, image=cached, hit=True), None
        self.metrics.cache_misses.inc()
        start = time.perf_counter()
        result = preprocess_image(self.encoder.processor, image.data, image.index, self.settings.max_image_pixels,
                                  uint8=self._uint8)
        self.metrics.preprocess_seconds.observe(time.perf_counter() - start)
        if isinstance(result, ItemError):
            return _Item(key=key, error=result), None
        pixel_values, grid = result
        if pixel_values.is_floating_point():
            # the tower casts its input to its dtype anyway (same rounding here): casting in this thread
            # halves what the batcher concatenates and copies to the device for bf16/fp16 towers
            pixel_values = pixel_values.to(self.encoder.loaded.dtype)
        return _Item(key=key), Job(pixel_values, grid)

    def _render(self, request: EncodeRequest, items: list[_Item]) -> list[bytes]:
        """In a pool thread: the response body's pieces (and the EC storage files)."""
        body, images, tokens = Body(), 0, 0
        body.add(b'{"model":', dumps(self.encoder.model_name), b',"data":[')
        for image, item in zip(request.images, items):
            if image.index:
                body.add(b",")
            if item.error is not None:
                self.metrics.errors.labels(kind=item.error.kind).inc()
                body.add(dumps({"index": image.index, "uuid": image.uuid,
                                "error": {"type": item.error.kind, "message": item.error.message}}))
                continue
            enc = item.image
            if self.ec is not None and self.ec.write(item.key, enc.full):
                self.metrics.ec_writes.inc()
            images, tokens = images + 1, tokens + enc.num_tokens
            uuid = image.uuid if image.uuid is not None else item.key
            meta = {"index": image.index, "uuid": uuid, "num_tokens": enc.num_tokens, "grid_thw": list(enc.grid_thw),
                    "cached": item.hit}
            body.add(*render_item(enc, request.format, meta, self.saver))
        body.add(b'],"usage":', dumps({"images": images, "tokens": tokens}), b"}")
        self.metrics.images.inc(images)
        self.metrics.tokens.inc(tokens)
        self.metrics.cache_bytes.set(self.cache.nbytes)
        self.metrics.cache_entries.set(len(self.cache))
        return body.done()


def _warmup_image() -> bytes:
    """A small PNG (64x64 gradient) that every processor accepts."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    pixels = np.stack([np.tile(ramp, (64, 1)), np.tile(ramp[:, None], (1, 64)), np.full((64, 64), 128, np.uint8)], -1)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
