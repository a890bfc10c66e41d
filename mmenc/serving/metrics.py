"""Prometheus metrics of one server, in their own registry (no process-wide state).

With front ends (`mmenc serve --frontends N`) every process of the server writes its metrics with
prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the engine before any of
its processes imports prometheus_client: mmenc/serving/frontends/metrics_dir.py) and `render` adds
them all up: counters and histograms sum over processes, gauges too ("livesum": the files of a
process that has died are dropped by mark_process_dead). prometheus_client is imported when the
first ServeMetrics is built, so importing this module does not fix the mode."""
import os
from collections.abc import Callable

from mmenc.serving.cache import CacheStats

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_PATCHES = (256, 1024, 4096, 8192, 16384, 32768, 65536, 131072)
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The multiprocess metrics folder of this process, or None in single-process mode."""
    return os.environ.get(MULTIPROC_ENV) or None


class ServeMetrics:
    def __init__(self, cache_stats: Callable[[], CacheStats | None] | None = None):
        """cache_stats: where the encoder cache's metrics come from at each scrape, when the cache is shared
        by several servers (a Ray deployment: every replica's /metrics shows the deployment's counts);
        this process's own cache counters are then kept but not exported."""
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        def gauge(name: str, doc: str, labels=(), registry=None):
            return Gauge(name, doc, list(labels), registry=registry or r, multiprocess_mode="livesum")

        r = self.registry = CollectorRegistry()
        self.requests = Counter("mmenc_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.images = Counter("mmenc_images", "images answered with embeddings", registry=r)
        self.tokens = Counter("mmenc_tokens", "embedding rows answered", registry=r)
        self.texts = Counter("mmenc_texts", "texts embedded (POST /v1/embeddings)", registry=r)
        self.errors = Counter("mmenc_errors", "failed images and refused requests, by kind", ["kind"], registry=r)
        self.cancelled = Counter("mmenc_cancelled_images", "images abandoned by their client before the answer", registry=r)
        self.queue_depth = gauge("mmenc_queue_depth", "images waiting for the tower")
        self.in_flight = gauge("mmenc_in_flight_images", "images admitted and not yet answered")
        self.batch_images = Histogram("mmenc_batch_images", "images per tower call", buckets=_COUNTS, registry=r)
        self.batch_patches = Histogram("mmenc_batch_patches", "patches per tower call", buckets=_PATCHES, registry=r)
        self.queue_seconds = Histogram("mmenc_queue_seconds", "time an image waited for its tower call",
                                       buckets=_SECONDS, registry=r)
        self.preprocess_seconds = Histogram("mmenc_preprocess_seconds", "decode + resize + patchify per image",
                                            buckets=_SECONDS, registry=r)
        self.tower_seconds = Histogram("mmenc_tower_seconds", "tower call, including the copy to the CPU",
                                       buckets=_SECONDS, registry=r)
        self.request_seconds = Histogram("mmenc_request_seconds",
                                         "POST /v1/encode and /v1/embeddings, body read to response",
                                         buckets=_SECONDS, registry=r)
        own = r if cache_stats is None else CollectorRegistry()  # not exported when the cache is shared
        self.cache_hits = Counter("mmenc_cache_hits", _CACHE_DOCS["hits"], registry=own)
        self.cache_misses = Counter("mmenc_cache_misses", _CACHE_DOCS["misses"], registry=own)
        self.cache_bytes = gauge("mmenc_cache_bytes", _CACHE_DOCS["nbytes"], registry=own)
        self.cache_entries = gauge("mmenc_cache_entries", _CACHE_DOCS["entries"], registry=own)
        if cache_stats is not None:
            r.register(_SharedCacheCollector(cache_stats))
        self.packings = gauge("mmenc_tower_packings", "distinct packings (grid lists) of the tower calls so far "
                              "(CUDA graphs replay per packing; counted up to 4096)")
        self.cuda_graph_calls = gauge("mmenc_cuda_graph_calls", "tower calls by CUDA graph outcome: eager (warm-up "
                                      "or no graph), captures, replays", ["kind"])
        self.ec_writes = Counter("mmenc_ec_storage_writes", "encoder-cache files written", registry=r)

    @property
    def content_type(self) -> str:
        from prometheus_client.exposition import CONTENT_TYPE_LATEST

        return CONTENT_TYPE_LATEST

    def render(self) -> bytes:
        """Prometheus text: this registry, or with front ends the sum over every process's files."""
        from prometheus_client import CollectorRegistry, generate_latest

        if multiprocess_dir() is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        combined = CollectorRegistry()
        MultiProcessCollector(combined)
        families = list(combined.collect())
        seen = {family.name for family in families}
        # a metric no process has a sample of yet (e.g. a labelled counter) is still listed, as one process lists it
        families += [_empty(family) for family in self.registry.collect() if family.name not in seen]
        return generate_latest(_Families(families))


_CACHE_DOCS = {"hits": "images answered from the encoder cache", "misses": "images that needed the tower",
               "nbytes": "bytes held by the encoder cache", "entries": "images held by the encoder cache",
               "shared_hits": "images answered by the shared cache tier (encoded by another replica)"}


class _SharedCacheCollector:
    """The cache metrics of a cache shared by several servers, read from it at each scrape."""

    def __init__(self, stats: Callable[[], CacheStats | None]):
        self.stats = stats

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        stats = self.stats()
        if stats is None:  # the shared cache did not answer (its client logged why)
            return
        for field in ("hits", "misses", "shared_hits"):
            yield CounterMetricFamily(f"mmenc_cache_{field}", _CACHE_DOCS[field], value=getattr(stats, field))
        for field, name in (("nbytes", "bytes"), ("entries", "entries")):
            yield GaugeMetricFamily(f"mmenc_cache_{name}", _CACHE_DOCS[field], value=getattr(stats, field))


class _Families:
    """A fixed list of metric families, in the shape generate_latest reads (a registry's collect)."""

    def __init__(self, families: list):
        self.families = families

    def collect(self):
        return iter(self.families)


def _empty(family):
    from prometheus_client.metrics_core import Metric

    return Metric(family.name, family.documentation, family.type, family.unit)
