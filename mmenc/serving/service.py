"""EncodeService: the request pipeline behind the HTTP routes, over an EngineClient (the tower in
this process, LocalEngine, or in the engine process, frontends.remote). Admits requests against
the queue bound, preprocesses each image in a thread pool, answers repeats from the encoder cache,
sends the rest to the engine, and renders the response items."""
import asyncio
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable

from mmenc.logger import init_logger
from mmenc.serving.batcher import Batcher, Job
from mmenc.serving.cache import content_key
from mmenc.serving.drain import Drain
from mmenc.serving.ec_storage import ECStorage
from mmenc.serving.engine_client import Encoded, EngineClient, describe, done_future
from mmenc.serving.formats import Body, EncodedImage, dumps, render_item
from mmenc.serving.inputs import EncodeRequest, ImageInput, ItemError, RequestError
from mmenc.serving.launch import make_batcher
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.pending import Pending
from mmenc.serving.preprocess import preprocess_image
from mmenc.serving.settings import ServeSettings
from mmenc.serving.tensor_bytes import TensorSaver
from mmenc.serving.video import VideoJobs, join, looks_like_video, prepare_video, video_options

logger = init_logger(__name__)


POOLED_SUFFIX = "/pooled"  # an image's pooled embedding is cached under its key + this (uuids hold no '/')


@dataclasses.dataclass
class Item:
    """One input on its way through the service: key (the uuid given, or the content key), the
    answer (EncodedImage: an image's rows, a pooled or text vector [1, dim]) or its error, and
    whether the cache gave it. A renderer (EncodeService.encode's `render`) reads these."""

    key: str | None = None
    image: EncodedImage | None = None
    error: ItemError | None = None
    hit: bool = False


class Admission:
    """Images admitted and not yet answered, bounded by max_queue_images. `shared` (a
    multiprocessing Value('q') with its lock) counts across the front-end processes of one server."""

    def __init__(self, limit: int, shared=None):
        self.limit, self._shared, self._count = limit, shared, 0

    def take(self, n: int) -> int | None:
        """None when admitted, else the count in flight (the request is refused)."""
        if self._shared is None:
            if self._count + n > self.limit:
                return self._count
            self._count += n
            return None
        with self._shared.get_lock():
            if self._shared.value + n > self.limit:
                return self._shared.value
            self._shared.value += n
        return None

    def give_back(self, n: int) -> None:
        if self._shared is None:
            self._count -= n
            return
        with self._shared.get_lock():
            self._shared.value -= n


class EncodeService:
    def __init__(self, settings: ServeSettings, make_encoder: Callable[[], object] | None = None,
                 metrics: ServeMetrics | None = None, *, batcher_factory: Callable[..., Batcher] = make_batcher,
                 engine: EngineClient | None = None, admission: Admission | None = None):
        """engine: the tower's side (default: a LocalEngine over make_encoder and batcher_factory,
        see mmenc/serving/local.py). admission: the queue bound (default: this process's own)."""
        self.settings = settings
        self.metrics = metrics if metrics is not None else ServeMetrics()
        if engine is None:
            from mmenc.serving.local import LocalEngine

            engine = LocalEngine(settings, make_encoder, self.metrics, batcher_factory=batcher_factory)
        self.engine = engine
        self.admission = admission or Admission(settings.max_queue_images)
        self.ec = ECStorage(settings.ec_storage) if settings.ec_storage else None
        self.pool = concurrent.futures.ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="mmenc-cpu")
        self._in_flight = 0  # this process's images in flight (the metric); touched on the event loop only
        self.saver = TensorSaver()  # torch.save bytes from per-shape templates (formats.torch_b64)
        self.drain = Drain()  # how this server stops (mmenc/serving/drain.py): begun by its HTTP host

    @property
    def state(self) -> str:
        return self.engine.state

    @property
    def load_error(self) -> str | None:
        return self.engine.load_error

    @property
    def card(self) -> dict:
        return self.engine.info.card if self.engine.info is not None else {}

    # -- life cycle --------------------------------------------------------------------------------
    def start_loading(self, on_failure: Callable[[], None] | None = None) -> threading.Thread | None:
        return self.engine.start(on_failure=on_failure)

    def loading(self) -> bool:
        return self.engine.loading()

    def busy(self) -> bool:
        return self.engine.busy()

    def close(self) -> None:
        """Stop the engine (a LocalEngine finishes its queued jobs and closes the Encoder), then the pool.
        After a drain's cut the answers are out already: a tower call still running gets TOWER_WAIT_AFTER_CUT_S
        (then the process exits without tearing torch down under it: server.serve)."""
        from mmenc.serving.uvicorn_run import TOWER_WAIT_AFTER_CUT_S

        self.drain.close()
        self.engine.close(timeout=TOWER_WAIT_AFTER_CUT_S if self.drain.state == "cut" else None)
        self.pool.shutdown(wait=True, cancel_futures=True)

    # -- one request -------------------------------------------------------------------------------
    async def encode(self, request: EncodeRequest,
                     render: Callable[[EncodeRequest, list[Item]], list[bytes]] | None = None) -> list[bytes]:
        """The JSON response body, in pieces (formats.Body): {"model": ..., "data": [item per image,
        input order], "usage": ...}. The event loop hands the request to the pool once and wakes once
        for the answer: pool threads prepare the images and submit them to the engine, the last
        result submits the rendering, which sets the answer (pending.Pending). render(request, items):
        another body (`/v1/embeddings`), run in a pool thread; a RequestError it raises is the answer."""
        if self.state != "ready":
            raise RequestError(503, "model", f"the encoder is {self.state}"
                               + (f" ({self.load_error})" if self.load_error else "; retry shortly"), kind="not_ready")
        info = self.engine.info
        if request.pooled and info.pooled_dim is None and any(item.text is None for item in request.images):
            raise RequestError(400, "pooled", f"{info.model_name!r} has no pooled image embedding (no CLIP projection "
                                              f"or SigLIP attention-pooling head: a VLM's tower); ask for its rows "
                                              f"(pooled=false)", kind="unsupported_model")
        texts = [item.index for item in request.images if item.text is not None]
        if texts and info.text_error is not None:
            raise RequestError(400, f"input[{texts[0]}]", f"texts cannot be embedded: {info.text_error}",
                               kind="unsupported_model")
        n = len(request.images)
        busy = self.admission.take(n)
        if busy is not None:
            raise RequestError(503, "images", f"queue full: {busy} images in flight, {n} more would exceed "
                                              f"max_queue_images={self.admission.limit}; retry later",
                               kind="queue_full")
        self._in_flight += n
        self.metrics.in_flight.set(self._in_flight)
        pending = Pending(n, lambda items: (render or self._render)(request, items))
        try:
            self.pool.submit(pending.guard, self._start, pending, request.images, video_options(request.video),
                             request.pooled)
            return await asyncio.wrap_future(pending.answer)
        except asyncio.CancelledError:  # the client left: its jobs not yet in a tower call are dropped
            self.metrics.cancelled.inc(pending.cancel())
            raise
        finally:
            self._in_flight -= n
            self.admission.give_back(n)
            self.metrics.in_flight.set(self._in_flight)

    def _start(self, pending: Pending, images: list[ImageInput], video=None, pooled: bool = False) -> None:
        """In a pool thread: the request's first image here, each other one in its own pool task.
        video: the request's VideoOptions (for its videos)."""
        for image in images[1:]:
            self.pool.submit(pending.guard, self._image, pending, image, video, pooled)
        self._image(pending, images[0], video, pooled)

    def _image(self, pending: Pending, image: ImageInput, video=None, pooled: bool = False) -> None:
        if image.error is not None:
            return pending.settle(image.index, Item(error=image.error), self.pool)
        if pending.answer.done():  # cancelled: nothing more to do
            return
        if image.text is not None:
            item = Item(key=content_key(self.engine.info.identity, b"\0text\0" + image.text.encode()))
            return self._await_engine(pending, image, item, self.engine.submit_text(item.key, image.text))
        if looks_like_video(image.data):
            if pooled:
                return pending.settle(image.index, Item(error=ItemError(
                    "unsupported_input", f"images[{image.index}]: a video has no pooled embedding; send its frames "
                                         f"as images")), self.pool)
            return self._video(pending, image, video)
        item, job = self._prepare(image, pooled)
        if item.image is not None:
            return pending.settle(image.index, item, self.pool)
        # a failed image (job None) still asks the cache: a uuid already cached answers whatever the bytes
        self._await_engine(pending, image, item, self.engine.submit(_cache_key(item.key, pooled), job))

    def _await_engine(self, pending: Pending, image: ImageInput, item: Item, future) -> None:
        """Settle `image` with the engine's answer `future` (Future[Encoded | None])."""
        def engine_done(future) -> None:  # in the thread that answers the engine's futures: cheap steps only
            if future.cancelled():
                return
            if future.exception() is not None:  # the tower failed for this batch: an item error, not a 500
                failed = Item(error=ItemError("encoder_error", f"images[{image.index}]: the tower failed "
                                                               f"({describe(future.exception())})"))
                return pending.settle(image.index, failed, self.pool)
            encoded = future.result()
            if encoded is not None:  # job None (the image could not be prepared) and its key was cached
                item.image, item.hit, item.error = encoded.image, encoded.cached, None
            pending.settle(image.index, item, self.pool)

        pending.track(future).add_done_callback(engine_done)

    def _video(self, pending: Pending, image: ImageInput, options) -> None:
        """A video item: its pieces' jobs (each cached under the video's key + "/k"), joined when all are back."""
        info = self.engine.info
        key = image.uuid or content_key(info.identity, image.data + repr(sorted(options.as_dict().items())).encode())
        start = time.perf_counter()
        jobs = prepare_video(info.video_processor, info.processor, image.data, image.index, options,
                             self.settings.max_batch_patches, info.uint8, info.dtype)
        self.metrics.preprocess_seconds.observe(time.perf_counter() - start)
        if not isinstance(jobs, VideoJobs):
            return pending.settle(image.index, Item(key=key, error=jobs), self.pool)
        parts: list = [None] * len(jobs.parts)
        left, lock = [len(parts)], threading.Lock()

        def piece_done(k: int, future) -> None:  # the engine's answer thread: cheap steps only
            if future.cancelled():
                return
            error = future.exception() or (None if future.result() is not None else RuntimeError("no answer"))
            with lock:
                if left[0] <= 0:  # settled already (a piece failed)
                    return
                if error is not None:
                    left[0] = 0
                else:
                    parts[k] = future.result()
                    left[0] -= 1
                done = left[0] == 0
            if error is not None:
                failed = ItemError("encoder_error", f"images[{image.index}]: the tower failed ({describe(error)})")
                return pending.settle(image.index, Item(key=key, error=failed), self.pool)
            if done:
                item = Item(key=key, image=join([p.image for p in parts], jobs), hit=all(p.cached for p in parts))
                pending.settle(image.index, item, self.pool)

        for k, (suffix, pixel_values, grid) in enumerate(jobs.parts):
            cached = self.engine.lookup(key + suffix)
            if cached is not None:
                piece_done(k, done_future(Encoded(cached, True)))
                continue
            future = self.engine.submit(key + suffix, Job(pixel_values, grid))
            pending.track(future).add_done_callback(lambda f, k=k: piece_done(k, f))

    def _prepare(self, image: ImageInput, pooled: bool = False) -> tuple[Item, Job | None]:
        """In a pool thread: key, cache lookup, then (on a miss) decode + preprocess."""
        info = self.engine.info
        key = image.uuid or content_key(info.identity, image.data)
        cached = self.engine.lookup(_cache_key(key, pooled))
        if cached is not None:
            return Item(key=key, image=cached, hit=True), None
        start = time.perf_counter()
        result = preprocess_image(info.processor, image.data, image.index, self.settings.max_image_pixels,
                                  uint8=info.uint8)
        self.metrics.preprocess_seconds.observe(time.perf_counter() - start)
        if isinstance(result, ItemError):
            return Item(key=key, error=result), None
        pixel_values, grid = result
        if pixel_values.is_floating_point():
            # the tower casts its input to its dtype anyway (same rounding here): casting in this thread
            # halves what the batcher concatenates and copies to the device for bf16/fp16 towers
            pixel_values = pixel_values.to(info.dtype)
        return Item(key=key), Job(pixel_values, grid, pooled=pooled)

    def _render(self, request: EncodeRequest, items: list[Item]) -> list[bytes]:
        """In a pool thread: the response body's pieces (and the EC storage files)."""
        body, images, tokens = Body(), 0, 0
        body.add(b'{"model":', dumps(self.engine.info.model_name), b',"data":[')
        for image, item in zip(request.images, items):
            if image.index:
                body.add(b",")
            if item.error is not None:
                self.metrics.errors.labels(kind=item.error.kind).inc()
                body.add(dumps({"index": image.index, "uuid": image.uuid,
                                "error": {"type": item.error.kind, "message": item.error.message}}))
                continue
            enc = item.image
            if self.ec is not None and not request.pooled and self.ec.write(item.key, enc.full):
                self.metrics.ec_writes.inc()
            images, tokens = images + 1, tokens + enc.num_tokens
            uuid = image.uuid if image.uuid is not None else item.key
            meta = {"index": image.index, "uuid": uuid, "num_tokens": enc.num_tokens, "grid_thw": list(enc.grid_thw),
                    "cached": item.hit}
            if enc.video is not None:  # the video's metadata (grid rows, frames, timestamps, ...)
                meta["video"] = enc.video
            body.add(*render_item(enc, request.format, meta, self.saver, grid=self.engine.info.vllm_grid))
        body.add(b'],"usage":', dumps({"images": images, "tokens": tokens}), b"}")
        self.metrics.images.inc(images)
        self.metrics.tokens.inc(tokens)
        return body.done()


def _cache_key(key: str, pooled: bool) -> str:
    return key + POOLED_SUFFIX if pooled else key
