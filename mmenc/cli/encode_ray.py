"""`mmenc encode --ray`: the flags and the command (mmenc/cli/encode.py delegates here; the job is mmenc.ray.data)."""
import argparse
import os
import sys
from collections.abc import Callable, Collection



def add_ray_encode_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Ray Data (pip install 'mmenc[ray]'; docs/scaling.md)")
    g.add_argument("--ray", action="store_true",
                   help="run on Ray Data: CPU workers preprocess, one encoder actor per GPU, --output is a FOLDER of "
                        "shards that a rerun resumes; inputs may also be URIs pyarrow reads (s3://, gs://, ...)")
    g.add_argument("--shard-size", type=int, default=None, metavar="N",
                   help="with --ray: images per shard file, the unit written as soon as it is done and skipped by a "
                        "rerun (default: about 1/32 of the job, 1..1024; a resumed folder keeps its own)")
    g.add_argument("--encoders", type=int, default=None, metavar="N",
                   help="with --ray: encoder actors (default: one per GPU of the cluster, 1 without GPUs)")
    g.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --ray: join this cluster ('auto': the one `ray start` made here); default: a local "
                        "Ray bound to 127.0.0.1")


def list_inputs(inputs: list[str], collect_images: Callable[[list[str]], list[str]],
                extensions: Collection[str]) -> list[str]:
    """Local files and folders expanded by `collect_images` (mmenc encode's); URIs (scheme://...)
    listed through pyarrow's filesystems, folders recursively, files ending in `extensions` only."""
    local = [item for item in inputs if "://" not in item]
    keys = collect_images(local) if local else []
    for uri in (item for item in inputs if "://" in item):
        import pyarrow.fs

        fs, path = pyarrow.fs.FileSystem.from_uri(uri)
        info = fs.get_file_info(path)
        if info.type == pyarrow.fs.FileType.NotFound:
            raise FileNotFoundError(f"input {uri!r} does not exist")
        scheme = uri.split("://", 1)[0]
        if info.type == pyarrow.fs.FileType.Directory:
            found = [f"{scheme}://{f.path}" for f in fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
                     if f.type == pyarrow.fs.FileType.File and os.path.splitext(f.path)[1].lower() in extensions]
            if not found:
                raise FileNotFoundError(f"folder {uri!r} holds no image files")
            keys += found
        else:
            keys.append(uri)
    return list(dict.fromkeys(keys))


def run_encode(args, collect_images: Callable[[list[str]], list[str]], extensions: Collection[str]) -> int:
    """The command; collect_images / extensions: how `mmenc encode` finds images (passed in, so this
    module does not import encode.py, which imports it)."""
    from mmenc.cli.common import apply_log_level, encoder_kwargs
    from mmenc.cli.progress import Progress
    from mmenc.cli.signals import describe, exit_code, stop_on_signals  # again: ray.init set its own
    from mmenc.engine.encoder import DEFAULT_MODEL
    from mmenc.ray.cluster import connect, import_ray, quiet_ray_logs
    from mmenc.ray.data import OfflineSettings, run_job

    apply_log_level(args)
    if os.path.isfile(args.output):
        raise ValueError(f"--output {args.output!r} is a file; with --ray it is a folder of shards: pass a folder")
    keys = list_inputs(args.inputs, collect_images, extensions)
    kwargs = encoder_kwargs(args, DEFAULT_MODEL)
    pixel_dtype = args.dtype if args.dtype in ("bfloat16", "float16") else "float32"
    from mmenc.cli.encode_video import video_options

    settings = OfflineSettings(output=args.output, shard_size=args.shard_size, encoders=args.encoders,
                               batch_size=args.batch_size, max_image_pixels=_pixel_limit(args.max_image_pixels),
                               pixel_dtype=pixel_dtype, video=video_options(args).as_dict())
    started = connect(args.ray_address)
    if args.quiet:
        quiet_ray_logs()
    try:
        with stop_on_signals(), Progress(len(keys), unit="images", label="mmenc encode --ray", enabled=not args.quiet) as progress:
            shards = [0]
            progress.note = lambda: f"{shards[0]} shard(s) written"

            def on_shard(index, report) -> None:
                shards[0] = report.shards_written
            report = run_job(keys, kwargs, settings, on_shard=on_shard, progress=progress)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP (mmenc encode's run handles the last two alike)
        print(f"\nmmenc encode --ray: {describe(e)}; the finished shards are in {args.output} and a rerun with "
              f"the same inputs resumes after them", file=sys.stderr)
        return exit_code(e)
    finally:
        if started:
            import_ray().shutdown()
    print(f"model={kwargs['model']} {report.line()} output={args.output}")
    if report.failed:
        print(f"mmenc encode --ray: {len(report.failed)} of {len(keys)} images failed (named above)", file=sys.stderr)
    return 1 if report.failed else 0


def _pixel_limit(flag: int | None) -> int | None:
    """--max-image-pixels (None: PIL's limit, 0: none, N) -> load_image's max_pixels."""
    if flag is not None and flag < 0:
        raise ValueError(f"--max-image-pixels={flag} must be >= 0 (0: no limit)")
    return -1 if flag is None else (flag or None)
