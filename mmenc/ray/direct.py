"""Direct ingress for `mmenc serve --ray --ray-ingress direct`: each Ray Serve replica runs the
service's own uvicorn server on the service address, on a socket bound with SO_REUSEPORT, so the
replicas of one node share host:port and the kernel spreads new connections over them. No Serve
proxy sits in the answer's path (run 9b: Ray's Python proxy topped out near 0.27 GB/s of 2.4 MB
answers, so two replicas served 1.22x one); Ray still places, health-checks and restarts replicas.

What changes against the proxy ingress (docs/scaling.md): balancing is per connection, not per
request (a client's keep-alive connection stays on one replica); a replica that dies drops the
connections it holds (the client sees a reset and retries; no answer is ever wrong); autoscaling is
not available (Serve's router never sees the requests); each node's replicas listen on that node,
so several nodes need a TCP load balancer in front.
"""
import threading

from mmenc.logger import init_logger
from mmenc.serving.frontends.engine import bind
from mmenc.serving.settings import ServeSettings
from mmenc.serving.uvicorn_run import CUT_GRACE_S, draining_server

logger = init_logger(__name__)


class DirectServer:
    """uvicorn serving `app` on a SO_REUSEPORT socket, in a thread of the calling process."""

    def __init__(self, app, settings: ServeSettings):
        self.settings = settings
        self.sock = bind(settings.host, settings.port, reuse_port=True)
        self.server = draining_server(app, app.state.service, settings, log_level="warning")
        self.thread = threading.Thread(target=self._serve, name="mmenc-direct-ingress", daemon=True)
        self.thread.start()
        logger.info("direct ingress: this replica listens on %s:%d (SO_REUSEPORT)", settings.host, settings.port)

    def _serve(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except Exception:  # noqa: BLE001 - reported; check_health then fails and Ray restarts the replica
            logger.exception("direct ingress: the HTTP server stopped with an error")

    def alive(self) -> bool:
        return self.thread.is_alive()

    def stop(self) -> None:
        """Stop accepting, let the requests in flight finish (up to shutdown_timeout_s), close the socket."""
        self.server.should_exit = True
        self.thread.join(self.settings.shutdown_timeout_s + CUT_GRACE_S + 5.0)
        self.sock.close()


class DirectReplica:
    """A Serve replica that serves HTTP itself (see the module doc). Its encoder is loaded before the
    replica reports ready; a failed load fails the replica with the loader's error."""

    def __init__(self, settings: ServeSettings, encoder_kwargs: dict, shared_cache=None, drain: str | None = None):
        from mmenc.ray.replica import replica_app

        self.app = replica_app(settings, encoder_kwargs, shared_cache, drain)
        self.direct = DirectServer(self.app, settings)

    def check_health(self) -> None:
        """Ray Serve's periodic health check: a failed encoder or a stopped HTTP server restarts the replica."""
        service = self.app.state.service
        if service.state != "ready":
            raise RuntimeError(f"mmenc replica is {service.state}: {service.load_error}")
        if not self.direct.alive():
            raise RuntimeError("mmenc replica's HTTP server (direct ingress) has stopped")

    def __del__(self):  # Serve's graceful replica shutdown: drain; the app's lifespan then closes the service
        direct = getattr(self, "direct", None)
        if direct is not None:
            direct.stop()
