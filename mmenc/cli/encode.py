"""`mmenc encode IMAGE_OR_DIR...`: embeddings for every image, written to one safetensors file."""
import argparse
import os
import sys
import time

from mmenc.cli.common import add_encoder_args, encoder_kwargs
from mmenc.engine.encoder import DEFAULT_MODEL

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("encode", help="encode images into vision-tower embeddings",
                       description="Encode images (files or folders) and write their embeddings to a safetensors "
                                   "file keyed by the path as given, with '<path>.grid_thw' beside each.")
    p.add_argument("inputs", nargs="+", metavar="IMAGE_OR_DIR")
    add_encoder_args(p, f"default: {DEFAULT_MODEL} with random weights")
    p.add_argument("--output", "-o", default="embeddings.safetensors", help="output file (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16, help="images per tower call (default: %(default)s)")
    return p


def collect_images(inputs: list[str]) -> list[str]:
    """Files as given, folders expanded to their image files (sorted, recursive)."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(root, f) for root, _, files in os.walk(item) for f in files
                           if os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS)
            if not found:
                raise FileNotFoundError(f"folder {item!r} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            paths += found
        elif os.path.exists(item):
            paths.append(item)
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
    return paths


def run(args) -> int:
    from mmenc.engine.encoder import Encoder
    from mmenc.preprocess.images import load_images

    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} must be >= 1")
    paths = collect_images(args.inputs)
    if args.model is None:
        print(f"mmenc encode: no --model given: running the built-in {DEFAULT_MODEL} vision tower with RANDOM "
              f"weights (a demo of the pipeline; pass a checkpoint folder for real embeddings)", file=sys.stderr)
    encoder = Encoder(**encoder_kwargs(args, DEFAULT_MODEL))
    tensors, failed, tokens = {}, [], 0
    start = time.perf_counter()
    with encoder:
        for first in range(0, len(paths), args.batch_size):
            batch = paths[first:first + args.batch_size]
            images, failures = load_images(batch, errors="skip")
            failed += [f.message for f in failures]  # each message names its input
            good = [p for i, p in enumerate(batch) if i not in {f.index for f in failures}]
            if good:
                pixel_values, grid_thw = encoder.preprocess(images)
                out = encoder.encode_pixels(pixel_values, grid_thw)
                for path, emb, grid in zip(good, out.split(encoder.output_tokens(grid_thw)), grid_thw):
                    tensors[path] = emb.float().cpu().contiguous()
                    tensors[f"{path}.grid_thw"] = grid.clone()
                    tokens += emb.shape[0]
            _progress(min(first + args.batch_size, len(paths)), len(paths), start)
    seconds = time.perf_counter() - start
    print(file=sys.stderr)
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, args.output, metadata={"model": encoder.model_name, "backend": _backend_name(encoder)})
    done = len(paths) - len(failed)
    print(f"model={encoder.model_name} backend={_backend_name(encoder)} images={done} tokens={tokens} "
          f"seconds={seconds:.2f} images/s={done / seconds:.2f} output={args.output if tensors else '(none)'}")
    for line in failed:
        print(f"mmenc encode: failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def _backend_name(encoder) -> str:
    return encoder.attention_backends()


def _progress(done: int, total: int, start: float) -> None:
    width = 30
    filled = width * done // max(total, 1)
    rate = done / max(time.perf_counter() - start, 1e-9)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} images {rate:.1f} img/s",
          end="", file=sys.stderr, flush=True)
