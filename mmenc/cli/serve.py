"""`mmenc serve`: run the encoder as an HTTP service (see docs/serving.md)."""
import argparse
import sys

from mmenc.cli.common import add_encoder_args, apply_log_level, encoder_kwargs
from mmenc.cli.flags import add_settings_flags
from mmenc.cli.flags import settings_from_args as flag_settings
from mmenc.engine.encoder import DEFAULT_MODEL
from mmenc.serving.settings import ServeSettings


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("serve", help="serve the encoder over HTTP (POST /v1/encode, /v1/embeddings)",
                       description="Serve the vision encoder over HTTP: POST /v1/encode returns embeddings as vLLM "
                                   "image_embeds, raw base64 or JSON; POST /v1/embeddings is the OpenAI embeddings "
                                   "API (texts and images of CLIP / SigLIP checkpoints); GET /health, /v1/models, "
                                   "/metrics. See docs/serving.md.")
    add_encoder_args(p, f"default: {DEFAULT_MODEL} with random weights")
    add_settings_flags(p, "serve", ServeSettings)  # --host, --port, the limits: ServeSettings' fields
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
    """ServeSettings from the flags (each field's own flag; sizes such as --cache-bytes 512MiB parsed there)."""
    return flag_settings(args, ServeSettings)


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
    from mmenc.ray.cluster import cluster_gpus, connect, import_ray, quiet_ray_logs
    from mmenc.ray.serve import run as run_ray_serve

    settings = settings_from_args(args)  # flags checked before Ray starts
    kwargs = encoder_kwargs(args, DEFAULT_MODEL)
    ray_settings_from_args(args, cluster_gpus=0)
    if args.ray_address is None:  # a local Ray: its proxy (or the replicas) will listen here
        from mmenc.serving.uvicorn_run import bind

        bind(settings.host, settings.port, reuse_port=args.ray_ingress == "direct").close()
    started = connect(args.ray_address)
    if args.quiet:
        quiet_ray_logs()
    try:
        return run_ray_serve(settings, ray_settings_from_args(args, cluster_gpus()), kwargs, args.ray_address)
    finally:
        if started:
            import_ray().shutdown()
