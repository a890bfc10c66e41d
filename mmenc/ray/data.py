"""Offline corpora on Ray Data: `mmenc encode --ray INPUT... --output DIR`.

    files (sorted keys) -> shards of `shard_size` keys -> Ray Data: CPU tasks read + decode + resize +
    patchify (stages.preprocess_batch) -> one EncoderActor per GPU (tower loaded once per actor) ->
    this process writes DIR/shard-00000.safetensors ... as each shard completes

A shard file holds, per image, `<key>` ([tokens, out_hidden] in the tower's dtype, exactly as computed:
bfloat16 for a bf16 tower, half the bytes of float32) and `<key>.grid_thw` (int64 [3]), the layout of
`mmenc encode`'s file (which converts to float32); its metadata names the model, where the weights came
from (`weights`: "checkpoint" or "random", as `mmenc encode`'s file) and every failed key with its reason.
Files are renamed into place whole, so a rerun with the same inputs skips the shards already there
(DIR/manifest.json pins the key list and shard size, and a rerun with other inputs is refused).
A bad file is logged with its key and recorded as failed in its shard; the job goes on.
"""
import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable

from mmenc.files import write_atomically
from mmenc.logger import init_logger

logger = init_logger(__name__)
MANIFEST = "manifest.json"
PREPROCESS_MEMORY = 512 << 20  # bytes a CPU task reserves: a batch of decoded, resized float32 images


@dataclasses.dataclass(frozen=True)
class OfflineSettings:
    """output: the folder of shards. shard_size: images per shard file (the unit of resume); None:
    auto_shard_size (a shard every ~1/32 of the job, 1..1024 images, or the size a resumed folder has).
    encoders: Encoder actors (None: one per GPU of the cluster, or 1 without GPUs); gpus_per_encoder:
    GPUs each actor owns (None: 1 with GPUs, else 0); cpus_per_encoder: its CPUs. batch_size: images
    per tower call (at most the shard size, so a shard is written as soon as its images are back).
    preprocess_batch: images per CPU task. max_image_pixels: as load_image's
    max_pixels (-1: PIL's limit, None: none). pixel_dtype: dtype of the pixels shipped
    from the CPU tasks to the actors (bfloat16 halves the bytes for a bf16 tower; same rounding)."""

    output: str
    shard_size: int | None = None
    encoders: int | None = None
    gpus_per_encoder: float | None = None
    cpus_per_encoder: float = 1.0
    batch_size: int = 32
    preprocess_batch: int = 8
    max_image_pixels: int | None = -1
    pixel_dtype: str = "float32"
    video: dict = dataclasses.field(default_factory=dict)  # VideoOptions fields for the videos (fps, ...)
    video_piece_patches: int = 16384  # rows of one video piece (one row of the job each)

    def __post_init__(self):
        for field in ("shard_size", "batch_size", "preprocess_batch"):
            value = getattr(self, field)
            if field == "shard_size" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}={value!r} must be a positive integer")
        if self.encoders is not None and self.encoders < 1:
            raise ValueError(f"encoders={self.encoders} must be >= 1 (or None: one per GPU)")
        if self.pixel_dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"pixel_dtype={self.pixel_dtype!r}; expected float32, bfloat16 or float16")


@dataclasses.dataclass
class JobReport:
    images: int = 0
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    shards_written: int = 0
    shards_skipped: int = 0
    seconds: float = 0.0

    def line(self) -> str:
        rate = self.images / max(self.seconds, 1e-9)
        return (f"images={self.images} failed={len(self.failed)} shards_written={self.shards_written} "
                f"shards_skipped={self.shards_skipped} seconds={self.seconds:.2f} images/s={rate:.2f}")


MAX_SHARD_SIZE = 1024
SHARDS_PER_JOB = 32  # auto shard size: a job writes about this many shards, so a stop loses little


def auto_shard_size(images: int) -> int:
    """Images per shard when none is given: about 1/SHARDS_PER_JOB of the job, 1..MAX_SHARD_SIZE (20
    images: 1 per shard; 200: 7; 32768 and more: 1024)."""
    return max(1, min(MAX_SHARD_SIZE, -(-images // SHARDS_PER_JOB)))


def _keys_digest(keys: list[str]) -> str:
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()


def resolve_shard_size(output: pathlib.Path, keys: list[str], shard_size: int | None) -> int:
    """`shard_size`, else the one of a folder this job started before (same keys), else auto_shard_size."""
    if shard_size is not None:
        return shard_size
    path = output / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        if old.get("keys_sha256") == _keys_digest(keys) and isinstance(old.get("shard_size"), int):
            return old["shard_size"]
    return auto_shard_size(len(keys))


def shard_path(output: pathlib.Path, index: int) -> pathlib.Path:
    return output / f"shard-{index:05d}.safetensors"


def check_manifest(output: pathlib.Path, keys: list[str], shard_size: int, model: str) -> None:
    """Write DIR/manifest.json, or check that a rerun has the same keys, shard size and model."""
    digest = _keys_digest(keys)
    manifest = {"model": model, "shard_size": shard_size, "images": len(keys), "keys_sha256": digest}
    path = output / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        changed = [k for k in manifest if old.get(k) != manifest[k]]
        if changed:
            raise ValueError(f"--output {str(output)!r} holds shards of another job ({', '.join(changed)} differ: "
                             f"{ {k: old.get(k) for k in changed} } there, { {k: manifest[k] for k in changed} } "
                             f"now); pass a new --output folder, or the same inputs to resume")
        return
    output.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: pathlib.Path(tmp).write_text(json.dumps(manifest, indent=1)))


def run_job(keys: list[str], encoder_kwargs: dict, settings: OfflineSettings,
            on_shard: Callable[[int, JobReport], None] | None = None, progress=None) -> JobReport:
    """Encode every key (sorted; local paths or URIs) into shards under settings.output, skipping the
    shards already written. Ray must be initialised. on_shard(index, report) runs after each shard
    is written. progress: an object with advance(n), or None."""
    import ray

    from mmenc.engine.tower import build_tower
    from mmenc.ray.stages import EncoderActor, preprocess_batch
    from mmenc.ray.video_rows import expand_row, is_video_key, prepare_piece

    start = time.perf_counter()
    output = pathlib.Path(settings.output)
    keys = sorted(dict.fromkeys(keys))
    shard_size = resolve_shard_size(output, keys, settings.shard_size)
    check_manifest(output, keys, shard_size, str(encoder_kwargs["model"]))
    shards = [keys[i:i + shard_size] for i in range(0, len(keys), shard_size)]
    report = JobReport()
    pending = [i for i in range(len(shards)) if not shard_path(output, i).exists()]
    report.shards_skipped = len(shards) - len(pending)
    if progress is not None:
        progress.advance(len(keys) - sum(len(shards[i]) for i in pending))
    if report.shards_skipped:
        logger.info("resuming: %d of %d shards already in %s", report.shards_skipped, len(shards), output)
    if not pending:
        report.seconds = time.perf_counter() - start
        return report

    gpus = float(ray.cluster_resources().get("GPU", 0))
    per_actor = settings.gpus_per_encoder if settings.gpus_per_encoder is not None else (1.0 if gpus else 0.0)
    actors = settings.encoders or (max(1, int(gpus // per_actor)) if per_actor else 1)
    # shapes and the processor only; in the dtype the actors compute in (float32 for "auto" on CPU actors),
    # so what it logs is what runs
    on_cpu = not per_actor or str(encoder_kwargs.get("device") or "").startswith("cpu")
    dtype = encoder_kwargs.get("dtype", "auto")
    meta_tower = build_tower(encoder_kwargs["model"], load_format="dummy", device="meta",
                             dtype="float32" if dtype == "auto" and on_cpu else dtype)
    processor = meta_tower.processor
    logger.info("%d images in %d shards of %d (%d to write) on %d encoder actor(s), %s, dtype %s", len(keys),
                len(shards), shard_size, len(pending), actors, f"{per_actor:g} GPU(s) each" if per_actor else "CPU",
                str(meta_tower.dtype).removeprefix("torch."))
    rows = [{"key": key, "shard": i, "pos": pos} for i in pending for pos, key in enumerate(shards[i])]

    ctx = ray.data.DataContext.get_current()
    before = (ctx.execution_options.preserve_order, ctx.enable_progress_bars)
    ctx.execution_options.preserve_order = True  # shards complete in order: the driver holds about one
    ctx.enable_progress_bars = False  # ours is one line (progress=)
    # blocks are what Ray Data streams: at least one per shard to write, so each shard comes back (and is
    # written) as soon as its images are done, small jobs too (otherwise 20 images came back all at the end)
    blocks = max(1, len(rows) // settings.preprocess_batch, len(pending))
    ds = ray.data.from_items(rows, override_num_blocks=min(blocks, len(rows)))
    prepare = None
    if any(is_video_key(row["key"]) for row in rows):  # one row per video piece (mmenc.ray.video_rows)
        video = {"video_processor": meta_tower.video_processor, "options": dict(settings.video),
                 "piece_patches": settings.video_piece_patches}
        ds = ds.flat_map(expand_row, fn_kwargs=video, num_cpus=1)
        prepare = functools.partial(prepare_piece, **video)
    # CPU tasks (Ray Data spreads them over the nodes and retries them); each reserves memory for one
    # batch of large decoded images, and remote arguments unlike the actors' keep Ray Data from fusing
    # this stage into the encoder actors (which would then decode on the GPU actors' own few CPUs)
    ds = ds.map_batches(preprocess_batch, batch_size=min(settings.preprocess_batch, shard_size), batch_format="numpy",
                        num_cpus=1, memory=PREPROCESS_MEMORY,
                        fn_kwargs={"processor": processor, "max_pixels": settings.max_image_pixels,
                                   "pixel_dtype": settings.pixel_dtype, "prepare_piece": prepare,
                                   "high_bit_depth": encoder_kwargs.get("high_bit_depth", "clip")})
    ds = ds.map_batches(EncoderActor, batch_size=min(settings.batch_size, shard_size), batch_format="numpy",
                        compute=ray.data.ActorPoolStrategy(size=actors), num_gpus=per_actor,
                        num_cpus=settings.cpus_per_encoder,
                        fn_constructor_kwargs={"encoder_kwargs": encoder_kwargs,
                                               "pixel_dtype": settings.pixel_dtype})
    try:
        _collect(ds, shards, output, encoder_kwargs, report, on_shard, progress)
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = before
    report.seconds = time.perf_counter() - start
    return report


def _collect(ds, shards, output, encoder_kwargs, report, on_shard, progress) -> None:
    """Gather rows per shard as they stream in; write a shard when all its images are back."""
    import torch

    from mmenc.ray.stages import DTYPES, from_bytes

    from mmenc.ray.video_rows import join_rows

    def embedding(r) -> torch.Tensor:
        return from_bytes(r["embedding"], DTYPES[str(r["dtype"])], (int(r["tokens"]), int(r["hidden"])))

    open_shards: dict[int, dict[int, list[dict]]] = {}  # shard -> pos -> its rows (a video: one per piece)
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        for j in range(len(batch["key"])):
            row = {name: column[j] for name, column in batch.items()}
            shard = int(row["shard"])
            rows = open_shards.setdefault(shard, {})
            parts = rows.setdefault(int(row["pos"]), [])
            parts.append(row)
            if row["error"] and str(row["key"]) not in report.failed:
                report.failed[str(row["key"])] = str(row["error"])
                print(f"mmenc encode --ray: failed: {row['error']}", file=sys.stderr, flush=True)
            if progress is not None and len(parts) == int(parts[0].get("pieces", 1)):
                progress.advance(1)  # this image (or video) is back
            if len(rows) < len(shards[shard]) or any(len(p) < int(p[0].get("pieces", 1)) for p in rows.values()):
                continue
            tensors, failed, metadata = {}, {}, {}
            weights = {str(p["weights"]) for parts in rows.values() for p in parts if p.get("weights")}
            if weights:  # the actors' Encoder.weights: "random" when the tower ran random weights
                metadata["weights"] = ",".join(sorted(weights))
            for pos in sorted(rows):
                r, key = rows[pos][0], str(rows[pos][0]["key"])
                errors = [str(p["error"]) for p in rows[pos] if p["error"]]
                if errors:
                    failed[key] = errors[0]
                elif r.get("video"):
                    joined = join_rows(rows[pos], embedding)
                    tensors.update(joined["tensors"])
                    metadata.update(joined["metadata"])
                else:
                    tensors[key] = embedding(r)
                    tensors[f"{key}.grid_thw"] = torch.tensor(r["grid"].tolist(), dtype=torch.int64)
            _write_shard(shard_path(output, shard), tensors, failed, encoder_kwargs, shard, metadata)
            report.images += len(rows) - len(failed)
            report.shards_written += 1
            del open_shards[shard]
            if on_shard is not None:
                on_shard(shard, report)


def _write_shard(path: pathlib.Path, tensors: dict, failed: dict, encoder_kwargs: dict, index: int,
                 extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    images = sum(1 for name in tensors if name.endswith(".grid_thw"))
    metadata = {"model": str(encoder_kwargs["model"]), "shard": str(index), "images": str(images),
                "failed": json.dumps(failed), **(extra or {})}
    write_atomically(path, lambda tmp: save_file(tensors, tmp, metadata=metadata))  # mode: the umask's


def read_shards(output: str | os.PathLike) -> tuple[dict, dict[str, str]]:
    """(key -> tensor for every shard under `output`, key -> failure reason)."""
    from safetensors import safe_open

    tensors, failed = {}, {}
    for path in sorted(pathlib.Path(output).glob("shard-*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            failed.update(json.loads(f.metadata().get("failed", "{}")))
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors, failed
