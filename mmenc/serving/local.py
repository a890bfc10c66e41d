"""LocalEngine: the Encoder in this process behind the EngineClient interface. Loads and warms the
tower (in a thread, so /health can answer 503 meanwhile), owns the encoder cache and the one
Batcher (the only caller of the tower)."""
import concurrent.futures
import io
import threading
import time
import weakref
from collections.abc import Callable

import torch

from mmenc.logger import init_logger
from mmenc.serving.batcher import Batcher, Job
from mmenc.serving.cache import EncoderCache, model_identity
from mmenc.serving.engine_client import EngineClient, EngineInfo, Encoded, done_future, settle
from mmenc.serving.formats import EncodedImage, dtype_name
from mmenc.serving.host_threads import one_intra_op_thread
from mmenc.serving.launch import make_batcher
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.settings import ServeSettings, served_name
from mmenc.vllm_inputs import takes_grid

logger = init_logger(__name__)


class LocalEngine(EngineClient):
    def __init__(self, settings: ServeSettings, make_encoder: Callable[[], object], metrics: ServeMetrics, *,
                 batcher_factory: Callable[..., Batcher] = make_batcher,
                 alloc: Callable[[tuple, torch.dtype], torch.Tensor] | None = None, cache=None):
        """batcher_factory(encoder, settings, metrics) -> the Batcher, once the encoder is loaded
        (default: launch.make_batcher; benchmarks/serve_stand_in.py passes a stand-in tower's).
        alloc(shape, dtype): where the batcher puts each image's embeddings (front ends: shared memory).
        cache: the encoder cache (default: an EncoderCache of settings.cache_bytes; a Ray replica passes a
        mmenc.ray.shared_cache.TieredCache: its put returns a Future, and the answer waits for it)."""
        self.settings, self.metrics = settings, metrics
        self._make_encoder, self._batcher_factory, self._alloc = make_encoder, batcher_factory, alloc
        self.state, self.load_error, self.info = "loading", None, None
        self.encoder = self.batcher = self.text_batcher = None
        self.cache = cache if cache is not None else EncoderCache(settings.cache_bytes)
        self._loader: threading.Thread | None = None
        self._closing = threading.Event()  # set by close(): a load still running stops at its next step

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, on_failure: Callable[[], None] | None = None,
              on_ready: Callable[[], None] | None = None) -> threading.Thread:
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
                return
            if self.state == "ready" and on_ready is not None:
                on_ready()
        self._loader = threading.Thread(target=load, name="mmenc-load", daemon=True)
        self._loader.start()
        return self._loader

    def _load(self) -> None:
        start = time.perf_counter()
        enc = self.encoder = self._make_encoder()
        if self._closing.is_set():  # stopped while loading: close() closes the encoder
            return
        one_intra_op_thread(enc.device, "mmenc serve")
        pixel_values, grid = enc.preprocess([_warmup_image()])
        out = enc.encode_pixels(pixel_values, grid, return_extras=True)
        warmed = enc.warm_up()  # what a first large request would build (a CPU's compiled RMSNorm, QuickGELU)
        hidden, levels = out.embeddings.shape[1], len(out.extras.get("deepstack") or [])
        loaded = enc.loaded
        archs = (getattr(loaded, "hf_config", None) or {}).get("architectures") or [type(loaded.config).__name__]
        text_error = self._start_text(enc)
        name = self.settings.served_model_name or served_name(enc.model_name)
        card = {"id": name, "object": "model", "architecture": archs[0], "hidden_size": hidden,
                "image_embeds_size": hidden * (1 + levels), "deepstack_levels": levels,
                "dtype": dtype_name(loaded.dtype), "weights": enc.weights, "pooled_dim": enc.pooled_dim,
                "text": text_error is None}
        identity = model_identity(enc.model_name, enc.processor, loaded.dtype)
        if self._closing.is_set():
            return
        self.batcher = self._batcher_factory(enc, self.settings, self.metrics)
        self.batcher.alloc = self._alloc
        hf_config = getattr(loaded, "hf_config", None) or {}
        self.info = EngineInfo(model_name=name, card=card, identity=identity, processor=enc.processor,
                               uint8=self.batcher.prepare is not None, dtype=loaded.dtype,
                               video_processor=enc.video_processor, pooled_dim=enc.pooled_dim,
                               text_error=text_error, matryoshka=matryoshka_dims(hf_config),
                               vllm_grid=takes_grid(archs[0]))
        self.state = "ready"
        logger.info("encoder %s ready in %.1f s (%s); linears %s; %s; warm-up: %s", enc.model_name,
                    time.perf_counter() - start, card, enc.linear_backend(), enc.threads(), warmed)

    def _start_text(self, enc) -> str | None:
        """Build and warm the text tower of a contrastive checkpoint and its TextBatcher; the reason texts
        cannot be embedded, or None. A checkpoint whose text side fails to load still serves images."""
        if not getattr(enc, "supports_text", False):
            return (f"{enc.model_name!r} has no text tower mmenc runs (texts need a CLIPModel, SiglipModel or "
                    f"Siglip2Model checkpoint folder with its tokenizer)")
        try:
            enc.embed_text(["warm-up"])
        except (ValueError, OSError) as e:
            logger.warning("texts will not be embedded: %s", e)
            return str(e)
        from mmenc.serving.text_batcher import TextBatcher

        self.text_batcher = TextBatcher(enc.embed_text, enc.text_tokens, self.settings.max_wait_ms)
        return None

    def loading(self) -> bool:
        """Whether the loader thread still runs (e.g. after close() gave up waiting for it)."""
        return self._loader is not None and self._loader.is_alive()

    def busy(self) -> bool:
        """Whether a thread of this engine still runs torch (a load, or a tower call close() did not wait
        out): the process must then exit without tearing torch down under it (uvicorn_run.exit_now)."""
        return self.loading() or (self.batcher is not None and self.batcher.alive())

    def close(self, timeout: float | None = None) -> None:
        """Stop: a load in progress stops at its next step (waited for up to shutdown_timeout_s; if it
        is still running then, it is left to the process exit, see server.serve), then the batcher
        finishes its queued jobs (waited for up to `timeout`, default shutdown_timeout_s) and the
        Encoder is closed (unless a tower call still runs)."""
        self._closing.set()
        if self.loading():
            logger.info("stopping while the encoder loads: waiting up to %.0f s for the load to stop",
                        self.settings.shutdown_timeout_s)
            self._loader.join(self.settings.shutdown_timeout_s)
            if self.loading():
                logger.warning("the encoder is still loading after %.0f s (shutdown_timeout_s); not waiting longer",
                               self.settings.shutdown_timeout_s)
                return
        if self.state == "loading":
            self.state = "stopped"
        if self.batcher is not None:
            self.batcher.close(timeout=self.settings.shutdown_timeout_s if timeout is None else timeout)
            if self.batcher.alive():
                logger.warning("a tower call still runs after the shutdown wait; leaving it to the process exit")
                return
        if self.text_batcher is not None:
            self.text_batcher.close(timeout=self.settings.shutdown_timeout_s if timeout is None else timeout)
        if self.encoder is not None:
            self.encoder.close()

    # -- images ------------------------------------------------------------------------------------
    def lookup(self, key: str) -> EncodedImage | None:
        cached = self.cache.lookup(key)
        (self.metrics.cache_hits if cached is not None else self.metrics.cache_misses).inc()
        return cached

    def submit(self, key: str, job: Job | None) -> concurrent.futures.Future:
        if job is None:
            cached = self.cache.get(key)
            return done_future(Encoded(cached, True) if cached is not None else None)
        return self._answer(key, self.batcher.submit(job))

    def submit_text(self, key: str, text: str) -> concurrent.futures.Future:
        cached = self.lookup(key)
        if cached is not None:
            return done_future(Encoded(cached, True))
        if self.text_batcher is None:
            raise ValueError(self.info.text_error if self.info is not None else "the encoder is not loaded")
        return self._answer(key, self.text_batcher.submit(text))

    def _answer(self, key: str, tower: concurrent.futures.Future) -> concurrent.futures.Future:
        """Future[Encoded] of a tower future: the result cached under `key` first."""
        answer = concurrent.futures.Future()

        def tower_done(future) -> None:  # in the batcher's completer thread: cheap steps only
            if future.cancelled():
                answer.cancel()
                return
            if future.exception() is not None:
                return settle(answer, error=future.exception())
            image = future.result()
            stored = self.cache.put(key, image)
            self.metrics.cache_bytes.set(self.cache.nbytes)
            self.metrics.cache_entries.set(len(self.cache))
            if stored is None:
                return settle(answer, result=Encoded(image, False))
            stored.add_done_callback(lambda _: settle(answer, result=Encoded(image, False)))

        tower_ref = weakref.ref(tower)  # no cycle between the two futures: the job holds `tower`

        def cancel_tower(a) -> None:
            tower = tower_ref()
            if a.cancelled() and tower is not None:
                tower.cancel()
        answer.add_done_callback(cancel_tower)
        tower.add_done_callback(tower_done)
        return answer


def matryoshka_dims(hf_config: dict) -> tuple[int, ...] | bool:
    """The output widths a checkpoint was trained to be cut to, as vLLM reads config.json:
    `matryoshka_dimensions` (a list), or `is_matryoshka: true` (any width); () for a fixed width."""
    dims = hf_config.get("matryoshka_dimensions")
    if isinstance(dims, list) and all(isinstance(d, int) and d > 0 for d in dims):
        return tuple(sorted(set(dims)))
    return True if hf_config.get("is_matryoshka") is True else ()


def _warmup_image() -> bytes:
    """A small PNG (64x64 gradient) that every processor accepts."""
    import numpy as np
    from PIL import Image

    ramp = np.linspace(0, 255, 64, dtype=np.uint8)
    pixels = np.stack([np.tile(ramp, (64, 1)), np.tile(ramp[:, None], (1, 64)), np.full((64, 64), 128, np.uint8)], -1)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()
