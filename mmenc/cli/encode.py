"""`mmenc encode IMAGE_OR_DIR...`: embeddings for every image, written to one safetensors file.

Nothing is lost: the output path is checked before any work (its folder exists and is writable, it is
not a folder, it is not an input); an image that cannot be loaded or preprocessed fails alone (named
on stderr) and the others are encoded; the file is written atomically (a temporary file renamed onto
it) with whatever was encoded, also after Ctrl-C (exit 130), SIGTERM (143), SIGHUP (129) or a fatal error. When nothing was
encoded nothing is written, and an existing file of that name is left unchanged (and said so).
"""
import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

import torch

from mmenc.cli.common import (add_encoder_args, add_image_args, add_preprocess_args, apply_log_level, check_output_path,
                              encoder_kwargs, image_pixel_limit, write_atomically)
from mmenc.cli.encode_video import VIDEO_EXTENSIONS, add_video_args, encode_videos, planned_frames, video_options
from mmenc.cli.progress import Progress
from mmenc.cli.signals import describe, exit_code, stop_on_signals
from mmenc.engine.encoder import DEFAULT_MODEL

IMAGE_EXTENSIONS = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
CALL_SECONDS = 2.0  # a tower call is made smaller than --batch-size when it would take longer than this


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("encode", help="encode images and videos into vision-tower embeddings",
                       description="Encode images and videos (files or folders) and write their embeddings to a "
                                   "safetensors file keyed by the path as given, with '<path>.grid_thw' beside each "
                                   "(videos: also '<path>.frames_indices', '<path>.timestamps' and their metadata). "
                                   "An input that fails is reported and skipped; the others are written, also after "
                                   "Ctrl-C. --text FILE adds text embeddings (contrastive checkpoints).")
    p.add_argument("inputs", nargs="*", metavar="IMAGE_VIDEO_OR_DIR")
    add_encoder_args(p, f"default: {DEFAULT_MODEL} with random weights")
    p.add_argument("--output", "-o", default="embeddings.safetensors", help="output file (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=16,
                   help="most images per tower call (default: %(default)s); calls are made smaller while one would "
                        f"take over {CALL_SECONDS:.0f} s, so progress keeps moving. Images are decoded and resized "
                        "in parallel threads, ahead of the tower")
    add_image_args(p)
    add_video_args(p)
    add_preprocess_args(p)
    p.add_argument("--pooled", action="store_true",
                   help="write one pooled image embedding per image (CLIP's projected class token, SigLIP/SigLIP2's "
                        "attention-pooling head) instead of the token embeddings")
    p.add_argument("--text", metavar="FILE",
                   help="also embed the texts of FILE (one per line, blank lines skipped) with the checkpoint's "
                        "tokenizer and text tower (CLIPModel, SiglipModel, Siglip2Model): keys 'text:<line>', the "
                        "texts in the file's metadata 'texts'; in the space of --pooled image embeddings")
    from mmenc.cli.encode_ray import add_ray_encode_args

    add_ray_encode_args(p)  # --ray: the Ray Data job (mmenc/ray), a folder of shards
    return p


def collect_images(inputs: list[str]) -> list[str]:
    """Files as given, folders expanded to their image files (sorted, recursive); each path once."""
    paths = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(root, f) for root, _, files in os.walk(item) for f in files
                           if os.path.splitext(f)[1].lower() in IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
            if not found:
                raise FileNotFoundError(f"folder {item!r} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            paths += found
        elif os.path.exists(item):
            paths.append(item)
        else:
            raise FileNotFoundError(f"input {item!r} does not exist")
    return list(dict.fromkeys(paths))


@dataclasses.dataclass
class Results:
    """What the run has produced so far: tensors to write, failure messages (each names its file)."""

    tensors: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    failed: list[str] = dataclasses.field(default_factory=list)
    texts: dict[str, str] = dataclasses.field(default_factory=dict)  # key -> text (--text)
    images: int = 0  # inputs encoded, videos included
    tokens: int = 0
    videos: int = 0
    metadata: dict[str, str] = dataclasses.field(default_factory=dict)  # the file's metadata (video:PATH)

    def fail(self, message: str) -> None:
        self.failed.append(message)
        print(f"mmenc encode: failed: {message}", file=sys.stderr, flush=True)


class CallSizer:
    """Images per tower call: one first, then as many as fit in CALL_SECONDS (at most `limit`)."""

    def __init__(self, limit: int):
        self.limit, self.seconds_per_image = limit, None

    def size(self) -> int:
        if self.seconds_per_image is None:
            return 1
        return max(1, min(self.limit, int(CALL_SECONDS / max(self.seconds_per_image, 1e-9))))

    def observe(self, images: int, seconds: float) -> None:
        self.seconds_per_image = seconds / images


def run(args) -> int:
    with stop_on_signals():  # SIGTERM / SIGHUP stop the command as Ctrl-C does (mmenc.cli.signals)
        return _run(args)


def _run(args) -> int:
    if args.ray:  # the offline job on Ray Data: its own module, its own output (a folder of shards)
        from mmenc.cli.encode_ray import run_encode

        return run_encode(args, collect_images, IMAGE_EXTENSIONS | VIDEO_EXTENSIONS)
    from mmenc.engine.encoder import Encoder

    apply_log_level(args)
    if args.batch_size < 1:
        raise ValueError(f"--batch-size={args.batch_size} must be >= 1")
    if not args.inputs and not args.text:
        raise ValueError("give images or videos (IMAGE_VIDEO_OR_DIR ...), --text FILE, or both")
    texts = read_texts(args.text) if args.text else {}
    paths = collect_images(args.inputs)
    output = check_output_path(args.output, "--output", paths)
    kwargs = dict(encoder_kwargs(args, DEFAULT_MODEL), preprocess_worker_kind=args.preprocess_worker_kind,
                  preprocess_resize=args.preprocess_resize, high_bit_depth=args.high_bit_depth)
    if args.model is None:
        print(f"mmenc encode: no --model given: running the built-in {DEFAULT_MODEL} vision tower with RANDOM "
              f"weights (a demo of the pipeline; pass a checkpoint folder for real embeddings)", file=sys.stderr)
    results = Results()
    if not args.quiet:
        print(f"mmenc encode: loading {kwargs['model']} ...", file=sys.stderr, flush=True)
    with image_pixel_limit(args.max_image_pixels):  # PIL's limit, which the encoder's Preprocessor follows
        try:
            encoder = Encoder(**kwargs)
        except KeyboardInterrupt as e:
            print(f"\nmmenc encode: {describe(e)} while loading the model; nothing was written", file=sys.stderr)
            return exit_code(e)
        if not args.quiet:
            print(f"mmenc encode: linears {encoder.linear_backend()}; {encoder.threads()}", file=sys.stderr)
        with encoder:
            if texts:
                embed_texts(encoder, texts, results)
            written, interrupted, seconds = _encode_and_save(encoder, paths, args, output, results)
    print(f"model={encoder.model_name} weights={encoder.weights} backend={encoder.attention_backends()} images={results.images} "
          + (f"(videos={results.videos} frames={int(encoder.tally.snapshot().get('video_frames', 0))}) "
             if results.videos else "")
          + f"tokens={results.tokens} seconds={seconds:.2f} images/s={results.images / max(seconds, 1e-9):.2f} "
          f"output={output if written else '(none)'}")
    if results.failed:
        print(f"mmenc encode: {len(results.failed)} of {len(paths)} inputs failed (named above)", file=sys.stderr)
    if interrupted is not None:
        return exit_code(interrupted)
    return 1 if results.failed or not written else 0


def _encode_and_save(encoder, paths: list[str], args, output: pathlib.Path,
                     results: Results) -> tuple[bool, KeyboardInterrupt | None, float]:
    """Encode, then write: (written, the Ctrl-C / SIGTERM / SIGHUP that stopped it or None, seconds).
    After a fatal error the encoded part is written and the error raised again."""
    start = time.perf_counter()
    interrupted = None
    videos = [p for p in paths if os.path.splitext(p)[1].lower() in VIDEO_EXTENSIONS]
    images = [p for p in paths if p not in set(videos)]
    options = video_options(args)
    total = len(images) + sum(planned_frames(encoder, p, options) for p in videos)
    unit = "frames" if videos and not images else "images + video frames" if videos else "images"
    try:
        with Progress(total, unit=unit, label="mmenc encode", enabled=not args.quiet) as progress:
            encode_all(encoder, images, args.batch_size, results, progress, pooled=args.pooled)
            if videos:
                encode_videos(encoder, videos, options, results, progress)
    except KeyboardInterrupt as e:
        print(f"\nmmenc encode: {describe(e)} after {results.images} of {len(paths)} images", file=sys.stderr)
        interrupted = e
    except BaseException:
        print(f"mmenc encode: stopped by an error after {results.images} of {len(paths)} images", file=sys.stderr)
        save(encoder, output, results, complete=False, partial=True)
        raise
    seconds = time.perf_counter() - start
    complete = interrupted is None and results.images == len(paths)
    written = save(encoder, output, results, complete=complete, partial=interrupted is not None)
    return written, interrupted, seconds


def encode_all(encoder, paths: list[str], batch_size: int, results: Results, progress: Progress,
               pooled: bool = False) -> None:
    """Decode and resize in the encoder's Preprocessor threads (ahead of the tower, chunks of at most
    max_batch_patches patches), encode each chunk in calls sized by CallSizer, and put each image's
    embeddings into `results` as soon as its call returns (pooled: one [hidden] vector per image, the
    tower's pooling head). A file that fails is named and skipped."""
    sizer = CallSizer(batch_size)
    chunks = encoder.preprocessor.iter_chunks(paths, max_batch_patches=encoder.max_batch_patches, errors="skip")
    try:
        for chunk in chunks:
            for f in chunk.failures:
                results.fail(f.message)  # the message names the file
            progress.advance(len(chunk.failures))
            good = [paths[i] for i in chunk.indices]
            pieces = list(chunk.pixel_values.split(chunk.grid_thw[:, :3].prod(-1).tolist())) if good else []
            grids = chunk.grid_thw
            done = 0
            while done < len(good):
                call = slice(done, done + sizer.size())
                begin = time.perf_counter()
                out = encoder.encode_pixels(torch.cat(pieces[call]), grids[call], pooled=pooled)  # [tokens|images, D]
                sizer.observe(len(good[call]), time.perf_counter() - begin)
                rows = [1] * len(good[call]) if pooled else encoder.output_tokens(grids[call])
                for path, emb, grid in zip(good[call], out.split(rows), grids[call]):
                    results.tensors[path] = (emb[0] if pooled else emb).float().cpu().contiguous()
                    results.tensors[f"{path}.grid_thw"] = grid.clone()
                    results.tokens += emb.shape[0]
                    results.images += 1
                progress.advance(len(good[call]))
                done = call.stop
    finally:
        chunks.close()  # on Ctrl-C or an error: the images not started are cancelled


def read_texts(path: str) -> dict[str, str]:
    """--text FILE: 'text:<line number>' -> the line, for its non-blank lines (1-based numbers)."""
    try:
        lines = pathlib.Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path!r} cannot be read as UTF-8 text ({e}); pass a file of one text per line") from e
    texts = {f"text:{i}": line for i, line in enumerate(lines, 1) if line.strip()}
    if not texts:
        raise ValueError(f"--text {path!r} holds no text (every line is blank); put one text per line")
    return texts


def embed_texts(encoder, texts: dict[str, str], results: Results) -> None:
    """Each text's embedding [dim] into `results` under its key (Encoder.embed_text)."""
    vectors = encoder.embed_text(list(texts.values()))
    for key, vector in zip(texts, vectors):
        results.tensors[key] = vector.float().cpu().contiguous()
    results.texts.update(texts)


def save(encoder, output: pathlib.Path, results: Results, complete: bool, partial: bool) -> bool:
    """Write what was encoded (atomically; metadata complete="true" when every input was encoded);
    False, and a note on an existing file, when nothing was. partial: the run was cut short (say so)."""
    if not results.images and not results.texts:
        kept = f"; the existing {str(output)!r} is from an earlier run and was left unchanged" if output.exists() else ""
        print(f"mmenc encode: no image was encoded, so nothing was written{kept}", file=sys.stderr)
        return False
    from safetensors.torch import save_file

    metadata = {"model": encoder.model_name, "weights": encoder.weights, "backend": encoder.attention_backends(),
                "images": str(results.images), "complete": str(complete).lower(), **results.metadata}
    if results.videos:
        metadata["videos"] = str(results.videos)
    if results.texts:
        metadata["texts"] = json.dumps(results.texts, ensure_ascii=False)
    write_atomically(output, lambda tmp: save_file(results.tensors, tmp, metadata=metadata))
    if partial:
        print(f"mmenc encode: wrote the {results.images} encoded image(s) to {output} "
              f"(metadata complete=false)", file=sys.stderr)
    return True
