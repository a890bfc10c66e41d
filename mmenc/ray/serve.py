"""The encoder service on Ray Serve: N replicas behind one address, each running the very
EncodeService + FastAPI app of `mmenc serve` (mmenc.serving.app / service), so routes, formats,
errors, auth, limits and metrics are the same code. Batching stays in the service's one Batcher
per replica (no @serve.batch). See docs/scaling.md.

    mmenc serve --ray --replicas 2 --model /models/Qwen2.5-VL-7B-Instruct --port 8000
    serve run mmenc.ray.serve:app_builder model=/models/Qwen2.5-VL-7B-Instruct replicas=2

Per replica: the encoder, its batcher, its in-memory encoder cache and its Prometheus registry
(GET /metrics answers for the replica that took the request). Shared: the --ec-storage folder
(writes are atomic renames of content-keyed files, so replicas writing the same key are safe).
"""
import dataclasses
import os
import signal
import threading

from mmenc.logger import init_logger
from mmenc.ray.cluster import connect, import_ray
from mmenc.serving.settings import ServeSettings, parse_size

logger = init_logger(__name__)

INGRESSES = ("proxy", "direct")
CACHE_TIERS = ("shared", "replica")  # a cache shared by the replicas (mmenc.ray.shared_cache) or each its own


def parse_autoscale(text: str) -> tuple[int, int]:
    """'1:4' -> (1, 4): the fewest and most replicas."""
    lo, sep, hi = str(text).partition(":")
    if not (sep and lo.strip().isdigit() and hi.strip().isdigit()) or not 0 < int(lo) <= int(hi):
        raise ValueError(f"--autoscale={text!r} is not MIN:MAX with 0 < MIN <= MAX; write e.g. --autoscale 1:4")
    return int(lo), int(hi)


@dataclasses.dataclass(frozen=True)
class RayServeSettings:
    """replicas: a fixed replica count, or autoscale=(min, max) to scale on ongoing requests per
    replica (target_ongoing_requests). max_ongoing_requests: requests one replica holds at once (the
    router queues the rest; beyond max_queued_requests per caller Ray answers 503). gpus_per_replica:
    GPUs each replica owns (0 on CPU; tensor_parallel_size for the weights/data modes, all on one
    node). name: the Serve application and deployment name. ingress: "proxy" (Serve's HTTP proxy
    routes each request to a replica) or "direct" (each replica serves HTTP itself on the service
    address with SO_REUSEPORT, mmenc.ray.direct; no autoscaling). request_timeout_s: with the proxy
    ingress, the longest the proxy waits for a replica's answer before it answers 408 itself; it
    bounds the wait of a request whose replica died before Ray told the proxy so (a known Serve
    race), so a client never hangs. cache_tier: "shared" (each replica's encoder cache in front of one
    shared by the deployment, so a repeat hits wherever it lands: mmenc.ray.shared_cache) or "replica"
    (each replica's own only)."""

    replicas: int = 1
    autoscale: tuple[int, int] | None = None
    target_ongoing_requests: float = 8.0
    max_ongoing_requests: int = 64
    max_queued_requests: int = 1024
    gpus_per_replica: float = 0.0
    cpus_per_replica: float = 1.0
    name: str = "mmenc"
    ingress: str = "proxy"
    request_timeout_s: float = 120.0
    cache_tier: str = "shared"

    def __post_init__(self):
        if self.cache_tier not in CACHE_TIERS:
            raise ValueError(f"--ray-cache={self.cache_tier!r} must be one of {', '.join(CACHE_TIERS)}")
        if self.ingress not in INGRESSES:
            raise ValueError(f"--ray-ingress={self.ingress!r} must be one of {', '.join(INGRESSES)}")
        if self.ingress == "direct" and self.autoscale is not None:
            raise ValueError("--autoscale needs --ray-ingress proxy: with direct ingress Serve's router never sees "
                             "the requests it would scale on; give a fixed --replicas N")
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"--replicas={self.replicas!r} must be a positive integer")
        if self.autoscale is not None:
            parse_autoscale(f"{self.autoscale[0]}:{self.autoscale[1]}")
        for field in ("target_ongoing_requests", "max_ongoing_requests", "max_queued_requests", "cpus_per_replica",
                      "request_timeout_s"):
            if getattr(self, field) <= 0:
                raise ValueError(f"RayServeSettings.{field}={getattr(self, field)!r} must be > 0")
        if self.gpus_per_replica < 0:
            raise ValueError(f"RayServeSettings.gpus_per_replica={self.gpus_per_replica} must be >= 0")

    def deployment_options(self) -> dict:
        """Keyword arguments of serve.deployment(...)."""
        options = dict(name=self.name, max_ongoing_requests=self.max_ongoing_requests,
                       max_queued_requests=self.max_queued_requests,
                       ray_actor_options={"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica})
        if self.autoscale is None:
            options["num_replicas"] = self.replicas
        else:
            lo, hi = self.autoscale
            options["autoscaling_config"] = {"min_replicas": lo, "initial_replicas": lo, "max_replicas": hi,
                                             "target_ongoing_requests": self.target_ongoing_requests}
        return options


    def proxy_options(self, settings: ServeSettings) -> dict:
        """http_options of serve.start(...) for the proxy ingress."""
        return {"host": settings.host, "port": settings.port, "request_timeout_s": self.request_timeout_s}


def deployment(settings: ServeSettings, ray_settings: RayServeSettings, encoder_kwargs: dict,
               drain: str | None = None):
    """The bound Serve application (pass to serve.run): `ray_settings` replicas of EncoderReplica
    (proxy ingress) or of mmenc.ray.direct.DirectReplica (direct ingress), and with the shared cache
    tier one SharedCache replica, whose handle each of them gets. drain: the name of the driver's
    DrainControl actor (mmenc.ray.drain), None without one."""
    from ray import serve

    from mmenc.ray.replica import EncoderReplica

    shared = None
    if ray_settings.cache_tier == "shared" and settings.cache_bytes > 0:
        from mmenc.ray.shared_cache import SharedCache

        shared = serve.deployment(SharedCache, name=f"{ray_settings.name}-cache", num_replicas=1,
                                  max_ongoing_requests=1024,
                                  ray_actor_options={"num_cpus": 0.1}).bind(settings.cache_bytes)
    if ray_settings.ingress == "direct":
        from mmenc.ray.direct import DirectReplica

        cls = DirectReplica
    else:
        cls = serve.ingress()(EncoderReplica)
    return serve.deployment(cls, **ray_settings.deployment_options()).bind(settings, encoder_kwargs, shared, drain)


def app_builder(args: dict):
    """For `serve run mmenc.ray.serve:app_builder key=value ...` and Serve config files: `model`,
    `replicas` or `autoscale` (MIN:MAX), `gpus_per_replica`, any ServeSettings field (api_key,
    cache_bytes, ec_storage, ...) and Encoder keyword (dtype, tensor_parallel_size, ...)."""
    from mmenc.engine.encoder import DEFAULT_MODEL

    args = dict(args)
    ray_fields = {f.name for f in dataclasses.fields(RayServeSettings)}
    ray_kw = {k: _typed(RayServeSettings, k, args.pop(k)) for k in list(args) if k in ray_fields}
    # host and port are Serve's proxy's own settings, unless the replicas listen themselves
    serve_fields = {f.name for f in dataclasses.fields(ServeSettings)} - (
        set() if ray_kw.get("ingress") == "direct" else {"host", "port"})
    if "autoscale" in ray_kw:
        ray_kw["autoscale"] = parse_autoscale(ray_kw["autoscale"])
    serve_kw = {k: _typed(ServeSettings, k, args.pop(k)) for k in list(args) if k in serve_fields}
    encoder_kw = {"model": DEFAULT_MODEL, **args}
    return deployment(ServeSettings(**serve_kw), RayServeSettings(**ray_kw), encoder_kw)


def _typed(cls, name: str, value):
    """A `key=value` string from `serve run` cast to the field's default's type."""
    if name in ("cache_bytes", "max_request_bytes"):
        return parse_size(value, name)  # "2GiB" as on the command line
    default = getattr(cls(), name)
    if not isinstance(value, str) or default is None or isinstance(default, (str, tuple)):
        return value
    return type(default)(value) if not isinstance(default, bool) else value.lower() in ("1", "true", "yes")


def run(settings: ServeSettings, ray_settings: RayServeSettings, encoder_kwargs: dict,
        address: str | None = None) -> int:
    """`mmenc serve --ray`: deploy, serve on settings.host:port until SIGTERM/SIGINT, then drain every
    replica (mmenc.ray.drain: requests in flight get settings.shutdown_timeout_s, then 503
    shutting_down) and shut Serve down. address: a running cluster ("auto" or host:port); None starts
    a local Ray bound to loopback."""
    started = connect(address)
    from ray import serve

    from mmenc.ray.drain import drain_replicas, start_control
    from mmenc.serving.uvicorn_run import CUT_GRACE_S

    stop = threading.Event()  # handlers first: a signal while deploying must not hit Ray's own (abort)
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    drain_name = f"{ray_settings.name}-drain-{os.getpid()}"
    try:
        control = start_control(drain_name)
        app = deployment(settings, ray_settings, encoder_kwargs, drain_name)
        if ray_settings.ingress == "direct":  # the replicas listen on host:port themselves
            serve.start(proxy_location="Disabled")
            serve.run(app, name=ray_settings.name, route_prefix=None)
        else:
            serve.start(http_options=ray_settings.proxy_options(settings))
            serve.run(app, name=ray_settings.name, route_prefix="/")
        logger.info("mmenc serve --ray: %s on http://%s:%d", _describe(ray_settings), settings.host, settings.port)
        while not stop.wait(1.0):
            pass
        logger.info("mmenc serve --ray: stopping: draining the replicas (up to %.0f s)", settings.shutdown_timeout_s)
        for replica, summary in drain_replicas(control, settings.shutdown_timeout_s, CUT_GRACE_S).items():
            logger.info("mmenc serve --ray: replica %s: %s", replica[:8], summary)
        serve.shutdown()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if started:
            import_ray().shutdown()
    return 0


def _describe(s: RayServeSettings) -> str:
    count = f"{s.replicas} replica(s)" if s.autoscale is None else f"{s.autoscale[0]}..{s.autoscale[1]} replicas"
    return f"{count}, {s.gpus_per_replica:g} GPU(s) each, {s.ingress} ingress"
