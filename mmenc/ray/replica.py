"""One Ray Serve replica of the encoder service: the app of `mmenc serve` (mmenc.serving's
create_app over an EncodeService) with its encoder loaded in the replica, for both ingresses
(mmenc.ray.serve: Serve's proxy; mmenc.ray.direct: the replica listens itself)."""
from mmenc.serving.settings import ServeSettings


class EncoderReplica:
    """One replica. Its ASGI app (built at replica start by Serve, __serve_build_asgi_app__) is
    mmenc.serving's create_app over an EncodeService whose encoder is loaded before the replica reports
    ready, so Ray routes nothing to a replica that is still loading; a failed load fails the replica
    with the loader's error. shared_cache: the deployment's SharedCache handle, or None."""

    def __init__(self, settings: ServeSettings, encoder_kwargs: dict, shared_cache=None, drain: str | None = None):
        self.settings, self.encoder_kwargs, self.shared_cache, self.drain = settings, encoder_kwargs, shared_cache, drain

    def __serve_build_asgi_app__(self):
        return replica_app(self.settings, self.encoder_kwargs, self.shared_cache, self.drain)  # then Serve's `self.app`

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose encoder failed is restarted."""
        service = self.app.state.service
        if service.state != "ready":
            raise RuntimeError(f"mmenc replica is {service.state}: {service.load_error}")


def replica_app(settings: ServeSettings, encoder_kwargs: dict, shared_cache=None, drain: str | None = None):
    """The FastAPI app of one replica, with its encoder loaded (runs inside the replica). shared_cache: a
    SharedCache handle: the replica's cache is then a TieredCache over it, and /metrics reports the
    deployment's cache counts (mmenc.ray.shared_cache). drain: the name of the driver's DrainControl
    (mmenc.ray.drain), which tells the replica when to drain; None: Serve's own shutdown only."""
    from mmenc.engine.encoder import Encoder
    from mmenc.serving.app import create_app
    from mmenc.serving.cache import EncoderCache
    from mmenc.serving.local import LocalEngine
    from mmenc.serving.metrics import ServeMetrics
    from mmenc.serving.service import EncodeService

    def make_encoder():
        return Encoder(**encoder_kwargs)

    cache = EncoderCache(settings.cache_bytes)
    if shared_cache is not None:
        from mmenc.ray.shared_cache import TieredCache

        cache = TieredCache(cache, shared_cache)
    metrics = ServeMetrics(cache_stats=cache.stats if shared_cache is not None else None)
    engine = LocalEngine(settings, make_encoder, metrics, cache=cache)
    service = EncodeService(settings, make_encoder, metrics, engine=engine)
    service.start_loading().join()  # the app's lifespan calls start_loading again: it returns this load
    if service.state != "ready":
        raise RuntimeError(f"the encoder failed to load in this replica: {service.load_error}")
    app = create_app(service)
    app.state.service = service
    from mmenc.ray.drain import follow
    from mmenc.serving.uvicorn_run import CUT_GRACE_S

    follow(service, drain, CUT_GRACE_S)
    return app
