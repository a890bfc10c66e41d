"""`mmenc serve`: run the encoder as an HTTP service (see docs/serving.md)."""
import argparse
import sys

from mmenc.cli.common import add_encoder_args, apply_log_level, encoder_kwargs
from mmenc.engine.encoder import DEFAULT_MODEL
from mmenc.serving.settings import ServeSettings, parse_size

_D = ServeSettings()  # the defaults


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the encoder over HTTP (POST /v1/encode)",
                       description="Serve the vision encoder over HTTP: POST /v1/encode returns embeddings as vLLM "
                                   "image_embeds, raw base64 or JSON; GET /health, /v1/models, /metrics. "
                                   "See docs/serving.md.")
    add_encoder_args(p, f"default: {DEFAULT_MODEL} with random weights")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and in every answer (default: the Hub id given, or the "
                        "checkpoint folder's name; never its path)")
    p.add_argument("--host", default=_D.host, help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=int, default=_D.port, help="port (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    p.add_argument("--max-batch-patches", type=int, default=_D.max_batch_patches, metavar="N",
                   help="patches per tower call, across requests (default: %(default)s)")
    p.add_argument("--max-wait-ms", type=float, default=_D.max_wait_ms, metavar="MS",
                   help="longest wait for more images before a tower call (default: %(default)s)")
    p.add_argument("--cache-bytes", default="1GiB", metavar="SIZE",
                   help="encoder cache size, e.g. 512MiB; 0 turns it off (default: %(default)s)")
    p.add_argument("--ec-storage", default=None, metavar="DIR",
                   help="also write DIR/<key>/encoder_cache.safetensors for vLLM's file-based EC connector")
    p.add_argument("--max-request-bytes", default="64MiB", metavar="SIZE",
                   help="largest request body (default: %(default)s)")
    p.add_argument("--max-images-per-request", type=int, default=_D.max_images_per_request, metavar="N",
                   help="(default: %(default)s)")
    p.add_argument("--max-image-pixels", type=int, default=_D.max_image_pixels, metavar="N",
                   help="largest decoded width*height per image (default: %(default)s)")
    p.add_argument("--max-queue-images", type=int, default=_D.max_queue_images, metavar="N",
                   help="images admitted at once; beyond, 503 with Retry-After (default: %(default)s)")
    p.add_argument("--preprocess-threads", type=int, default=None, metavar="N",
                   help="decode/resize threads beside the tower (default: min(8, CPUs))")
    p.add_argument("--shutdown-timeout", type=float, default=_D.shutdown_timeout_s, metavar="S",
                   help="on SIGTERM, how long to let requests in flight finish (default: %(default)s)")
    p.add_argument("--max-in-flight", type=int, default=_D.max_in_flight, metavar="N",
                   help="tower calls launched and not yet handed back; 2 queues the next call on the device while "
                        "one runs (default: %(default)s)")
    p.add_argument("--bucket-batches", choices=("auto", "on", "off"), default=_D.bucket_batches,
                   help="cut each call's images of one size to a power of two so CUDA graphs replay; auto: on with "
                        "--cuda-graphs (default: %(default)s)")
    p.add_argument("--frontends", type=int, default=_D.frontends, metavar="N",
                   help="HTTP front-end processes: this process keeps the tower, batcher and cache, N processes "
                        "parse requests, decode images and render answers on one shared port; about one per "
                        "100-150 images/s. 0: one process (default: %(default)s)")
    ray = p.add_argument_group("Ray Serve (pip install 'mmenc[ray]'; docs/scaling.md)")
    ray.add_argument("--ray", action="store_true", help="serve through Ray Serve replicas (one per GPU) behind one address")
    ray.add_argument("--replicas", type=int, default=1, metavar="N", help="with --ray: replicas (default: %(default)s)")
    ray.add_argument("--autoscale", default=None, metavar="MIN:MAX",
                     help="with --ray: scale between MIN and MAX replicas on ongoing requests (instead of --replicas)")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="with --ray: join this cluster ('auto' = the one `ray start` made here); default: start "
                          "a local Ray bound to 127.0.0.1")
    ray.add_argument("--ray-ingress", choices=("proxy", "direct"), default="proxy",
                     help="with --ray: 'proxy' = Ray Serve's HTTP proxy routes each request; 'direct' = every replica "
                          "listens on --host:--port itself (SO_REUSEPORT, no proxy in the answer's path; no "
                          "--autoscale) (default: %(default)s)")
    ray.add_argument("--ray-request-timeout", type=float, default=120.0, metavar="S",
                     help="with --ray and the proxy ingress: the proxy answers 408 to a request no replica answered "
                          "within S seconds (e.g. one held by a replica that died) (default: %(default)s)")
    ray.add_argument("--ray-cache", choices=("shared", "replica"), default="shared",
                     help="with --ray: 'shared' = each replica's encoder cache in front of one the replicas "
                          "share, so a repeated image hits wherever it is routed; 'replica' = each replica's own "
                          "only (default: %(default)s)")
    return p


def ray_settings_from_args(args, cluster_gpus: float):
    """RayServeSettings from the flags: each replica owns --tensor-parallel-size GPUs when the cluster
    has GPUs and --device is not cpu, else none."""
    from mmenc.ray.serve import RayServeSettings, parse_autoscale

    on_gpu = cluster_gpus > 0 and not (args.device or "").startswith("cpu")
    autoscale = parse_autoscale(args.autoscale) if args.autoscale is not None else None
    return RayServeSettings(replicas=args.replicas, autoscale=autoscale, ingress=args.ray_ingress,
                            request_timeout_s=args.ray_request_timeout, cache_tier=args.ray_cache,
                            gpus_per_replica=float(args.tensor_parallel_size) if on_gpu else 0.0)


def settings_from_args(args) -> ServeSettings:
    extra = {} if args.preprocess_threads is None else {"preprocess_threads": args.preprocess_threads}
    return ServeSettings(host=args.host, port=args.port, api_key=args.api_key,
                         max_batch_patches=args.max_batch_patches, max_wait_ms=args.max_wait_ms,
                         cache_bytes=parse_size(args.cache_bytes, "--cache-bytes"), ec_storage=args.ec_storage,
                         max_request_bytes=parse_size(args.max_request_bytes, "--max-request-bytes"),
                         max_images_per_request=args.max_images_per_request,
                         max_image_pixels=args.max_image_pixels, max_queue_images=args.max_queue_images,
                         shutdown_timeout_s=args.shutdown_timeout, max_in_flight=args.max_in_flight,
                         bucket_batches=args.bucket_batches, frontends=args.frontends,
                         served_model_name=args.served_model_name, **extra)


def run(args) -> int:
    apply_log_level(args)  # -q / --log-level: mmenc's logger, and uvicorn's (mmenc.serving.server)
    if not args.ray and (args.autoscale is not None or args.replicas != 1 or args.ray_address is not None
                         or args.ray_ingress != "proxy" or args.ray_cache != "shared"):
        raise ValueError("--replicas, --autoscale, --ray-address, --ray-ingress and --ray-cache need --ray (one "
                         "process serves without it)")
    if args.ray:
        if args.frontends:
            raise ValueError(f"--frontends {args.frontends} does not combine with --ray yet; drop one of them")
        return _run_ray(args)
    try:
        from mmenc.serving.server import serve
    except ModuleNotFoundError as e:
        raise ValueError(f"mmenc serve needs {e.name}; install the serve extra: pip install 'mmenc[serve]'") from e
    from mmenc.engine.encoder import Encoder

    settings = settings_from_args(args)
    if args.model is None:
        print(f"mmenc serve: no --model given: serving the built-in {DEFAULT_MODEL} vision tower with RANDOM "
              f"weights (a demo; pass a checkpoint folder for real embeddings)", file=sys.stderr)
    kwargs = encoder_kwargs(args, DEFAULT_MODEL)
    return serve(settings, lambda: Encoder(**kwargs))


def _run_ray(args) -> int:
    from mmenc.ray.cluster import cluster_gpus, connect, import_ray
    from mmenc.ray.serve import run as run_ray_serve

    settings = settings_from_args(args)  # flags checked before Ray starts
    kwargs = encoder_kwargs(args, DEFAULT_MODEL)
    ray_settings_from_args(args, cluster_gpus=0)
    if args.ray_address is None:  # a local Ray: its proxy (or the replicas) will listen here
        from mmenc.serving.frontends.engine import bind

        bind(settings.host, settings.port, reuse_port=args.ray_ingress == "direct").close()
    started = connect(args.ray_address)
    try:
        return run_ray_serve(settings, ray_settings_from_args(args, cluster_gpus()), kwargs, args.ray_address)
    finally:
        if started:
            import_ray().shutdown()
