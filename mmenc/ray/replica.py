"""One Ray Serve replica of the encoder service: the app of `mmenc serve` (mmenc.serving's
create_app over an EncodeService) with its encoder loaded in the replica, for both ingresses
(mmenc.ray.serve: Serve's proxy; mmenc.ray.direct: the replica listens itself)."""
from mmenc.serving.settings import ServeSettings


class EncoderReplica:
    """One replica. Its ASGI app (built by `deployment`) is mmenc.serving's create_app over an
    EncodeService whose encoder is loaded before the replica reports ready, so Ray routes nothing to
    a replica that is still loading; a failed load fails the replica with the loader's error."""

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a replica whose encoder failed is restarted."""
        service = self.app.state.service
        if service.state != "ready":
            raise RuntimeError(f"mmenc replica is {service.state}: {service.load_error}")


def replica_app(settings: ServeSettings, encoder_kwargs: dict):
    """The FastAPI app of one replica, with its encoder loaded (runs inside the replica)."""
    from mmenc.engine.encoder import Encoder
    from mmenc.serving.app import create_app
    from mmenc.serving.metrics import ServeMetrics
    from mmenc.serving.service import EncodeService

    service = EncodeService(settings, lambda: Encoder(**encoder_kwargs), ServeMetrics())
    service.start_loading().join()  # the app's lifespan calls start_loading again: it returns this load
    if service.state != "ready":
        raise RuntimeError(f"the encoder failed to load in this replica: {service.load_error}")
    app = create_app(service)
    app.state.service = service
    return app
