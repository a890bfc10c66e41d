"""The encoder cache of a Ray Serve deployment: one tier in each replica, one shared by all of them, so a
repeated image is answered from the cache wherever Ray routes it (docs/scaling.md, "One cache").

Why a shared tier and not key-affinity routing: a content key is a hash of the image bytes, and Ray
Serve's proxy streams the request body to the replica after the router has chosen it, so no request
router can see the key (it could hash only headers; clients without uuids send none).

    SharedCache   a Serve deployment of one replica: an LRU of key -> EncodedImage bounded by bytes, and
                  the deployment's cache counters (hits in either tier, misses, shared-tier hits)
    TieredCache   in each encoder replica, where LocalEngine keeps its EncoderCache: the replica's own LRU
                  first; on a miss, one call to SharedCache; a new embedding goes to both, and its answer
                  waits for the shared copy (so a repeat sent after the answer hits on any replica)

Costs: one handle call per local miss (a round trip to the SharedCache replica) and per new embedding
(its bytes copied into the object store and the SharedCache's memory: up to --cache-bytes there, beside
each replica's own --cache-bytes). If the shared tier fails or is slow (SHARED_TIMEOUT_S), requests go on
without it (a miss; the embedding is stored locally) and a warning is logged.
"""
import concurrent.futures
import threading

from mmenc.logger import init_logger
from mmenc.serving.cache import CacheStats, EncoderCache
from mmenc.serving.formats import EncodedImage

logger = init_logger(__name__)

SHARED_TIMEOUT_S = 5.0


class SharedCache:
    """The shared tier (a Serve deployment class; one replica). Its methods are fast and take a lock."""

    def __init__(self, max_bytes: int):
        self.cache = EncoderCache(max_bytes)
        self._lock = threading.Lock()
        self.hits = self.misses = self.shared_hits = 0

    def get(self, key: str, count: bool = True) -> EncodedImage | None:
        """The entry of `key` (a replica's local miss); count: a lookup of the request path (counted)."""
        entry = self.cache.get(key)
        if count:
            with self._lock:
                if entry is None:
                    self.misses += 1
                else:
                    self.hits, self.shared_hits = self.hits + 1, self.shared_hits + 1
        return entry

    def put(self, key: str, image: EncodedImage) -> None:
        self.cache.put(key, image)

    def local_hits(self, n: int) -> None:
        """A replica answered n lookups from its own tier."""
        with self._lock:
            self.hits += n

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self.hits, self.misses, self.cache.nbytes, len(self.cache), self.shared_hits)


class TieredCache:
    """The replica's EncoderCache in front of a SharedCache handle (a DeploymentHandle). Same get/put as
    EncoderCache, so LocalEngine uses either; called from the service's pool threads and the batcher's
    completer, never from the replica's event loop (handle results are waited for here)."""

    def __init__(self, local: EncoderCache, shared):
        self.local, self.shared = local, shared
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mmenc-shared-cache")
        self._warned = False

    @property
    def max_bytes(self) -> int:
        return self.local.max_bytes

    @property
    def nbytes(self) -> int:
        return self.local.nbytes

    def __len__(self) -> int:
        return len(self.local)

    def lookup(self, key: str) -> EncodedImage | None:
        """A request's lookup: counted in the deployment's counters."""
        return self._get(key, count=True)

    def get(self, key: str) -> EncodedImage | None:
        return self._get(key, count=False)

    def _get(self, key: str, count: bool) -> EncodedImage | None:
        entry = self.local.get(key)
        if entry is not None:
            if count:
                self._call(lambda: self.shared.local_hits.remote(1))  # not waited for: a counter
            return entry
        if self.local.max_bytes == 0:
            return None
        entry = self._call(lambda: self.shared.get.remote(key, count).result(timeout_s=SHARED_TIMEOUT_S))
        if entry is not None:
            self.local.put(key, entry)
        return entry

    def put(self, key: str, image: EncodedImage) -> concurrent.futures.Future | None:
        """Store in both tiers; the Future is done once the shared tier has it (the caller answers then)."""
        self.local.put(key, image)
        if image.nbytes > self.local.max_bytes:
            return None
        return self._writer.submit(self._call, lambda: self.shared.put.remote(key, image).result(
            timeout_s=SHARED_TIMEOUT_S))

    def stats(self) -> CacheStats | None:
        """The deployment's counters (every replica's hits, the shared tier's size); None when the shared
        tier does not answer (the scrape then lists no cache samples)."""
        return self._call(lambda: self.shared.stats.remote().result(timeout_s=SHARED_TIMEOUT_S))

    def _call(self, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - the shared tier is an optimisation: go on without it
            if not self._warned:
                logger.warning("shared encoder cache unavailable (%s: %s); answering without it", type(e).__name__, e)
                self._warned = True
            return None
