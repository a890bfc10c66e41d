"""The Ray deployment's two-tier encoder cache (mmenc.ray.shared_cache) without Ray: TieredCache over a
stand-in for the SharedCache's DeploymentHandle (method.remote(...).result(timeout_s) calls the real
SharedCache), and the deployment-wide cache metrics it feeds (ServeMetrics(cache_stats=...))."""
import re

import pytest
import torch

from mmenc.ray.shared_cache import SharedCache, TieredCache
from mmenc.serving.cache import EncoderCache
from mmenc.serving.formats import EncodedImage

pytest.importorskip("prometheus_client")


class _Response:
    def __init__(self, fn, args):  # like Ray: the call runs whether or not its result is waited for
        try:
            self.value, self.error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - re-raised by result(), as a DeploymentResponse does
            self.value, self.error = None, e

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return _Response(self.fn, args)


class _Handle:
    """What a DeploymentHandle of `target` looks like to TieredCache; broken=True: every call raises."""

    def __init__(self, target, broken=False):
        self.target, self.broken = target, broken

    def __getattr__(self, name):
        if self.broken:
            def fail(*_):
                raise TimeoutError("the cache replica did not answer")
            return _Method(fail)
        return _Method(getattr(self.target, name))


def _image(seed: int) -> EncodedImage:
    return EncodedImage(torch.randn(4, 8, generator=torch.Generator().manual_seed(seed)), 8, (1, 4, 4))


def test_a_miss_here_is_a_hit_there_and_every_hit_is_counted():
    shared = SharedCache(1 << 20)
    a, b = (TieredCache(EncoderCache(1 << 20), _Handle(shared)) for _ in range(2))
    image = _image(0)
    assert a.lookup("k") is None
    stored = a.put("k", image)
    assert stored is not None and stored.result(timeout=5) is None  # the answer waits for the shared copy
    assert a.lookup("k") is image  # replica a's own tier
    got = b.lookup("k")  # replica b never encoded it: the shared tier answers, and b keeps a copy
    assert torch.equal(got.full, image.full) and len(b) == 1
    assert b.lookup("k") is got
    assert b.get("absent") is None  # a get (not a request's lookup) is not counted
    stats = shared.stats()
    assert (stats.hits, stats.misses, stats.shared_hits, stats.entries) == (3, 1, 1, 1)
    assert stats.nbytes == image.nbytes


def test_a_broken_shared_tier_is_a_miss_not_an_error(caplog):
    tiered = TieredCache(EncoderCache(1 << 20), _Handle(None, broken=True))
    assert tiered.lookup("k") is None
    assert tiered.put("k", _image(1)).result(timeout=5) is None
    assert tiered.lookup("k") is not None  # still cached locally
    assert tiered.stats() is None
    assert "shared encoder cache unavailable (TimeoutError" in caplog.text


def test_metrics_report_the_deployment_cache():
    from mmenc.serving.metrics import ServeMetrics

    shared = SharedCache(1 << 20)
    tiered = TieredCache(EncoderCache(1 << 20), _Handle(shared))
    metrics = ServeMetrics(cache_stats=tiered.stats)
    tiered.put("k", _image(2)).result(timeout=5)
    for _ in range(3):
        tiered.lookup("k")
    metrics.cache_hits.inc(100)  # this replica's own counter: kept, not exported
    text = metrics.render().decode()

    def sample(name):
        return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))
    assert (sample("mmenc_cache_hits_total"), sample("mmenc_cache_shared_hits_total"), sample("mmenc_cache_entries")) \
        == (3.0, 0.0, 1.0)
    broken = ServeMetrics(cache_stats=TieredCache(EncoderCache(1 << 20), _Handle(None, broken=True)).stats)
    assert "mmenc_cache_hits_total" not in broken.render().decode()
