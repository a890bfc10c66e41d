"""End to end: image files in, embeddings on the device out, side by side with transformers.

For each workload (a list of grids; the images are JPEG files of grid x patch-size pixels written
into a temporary folder), in one run and on the same files and weights:
  mmenc encode         `Encoder.encode(paths)`, wall time until the embeddings are on the device
  mmenc encode 1 call  the same with first_chunk_patches off (the tower waits for every image)
  ... first+rest       the same with chunk_growth=inf (the first chunk, then max_batch_patches: the
                       schedule before growing chunks)
  mmenc preprocess     the Encoder's Preprocessor alone (its share of the above)
  mmenc tower only     `Encoder.encode_pixels` on the preprocessed pixels (CUDA events)
  ... eager            with compile / CUDA graphs on: encode and tower only again without them
  transformers         PIL open + transformers.AutoImageProcessor (its default backend) + its tower
  transformers proc.   the processor alone
One more traced encode per workload (mmenc.bench.trace: tower calls, the gaps between them, lead-in,
host seconds). Plus a stream (many mixed-size files through `Encoder.encode_iter`: images/s, the
tower's share of the wall time = GPU busy fraction, its trace, and the tower alone over the same
packings) and a batch-invariance probe (an image alone vs the same image in
mixed batches: the largest difference of its embedding). Wall times are perf_counter medians after
warm-up, with the device synchronised; nothing here is imported by the engine.
"""
import contextlib
import dataclasses
import itertools
import json
import math
import pathlib
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from mmenc.bench.measure import time_ms
from mmenc.bench.trace import TowerTrace, tower_only_ms


@dataclasses.dataclass
class E2ERow:
    workload: str
    impl: str
    images: int
    ms: float

    @property
    def images_per_s(self) -> float:
        return self.images / (self.ms / 1e3)


def image_sizes(grids, patch_size: int) -> list[tuple[int, int]]:
    """(height, width) in pixels of one image per grid (t, h, w): h and w patches of patch_size."""
    return [(h * patch_size, w * patch_size) for _, h, w in grids]


def write_jpegs(folder: pathlib.Path, sizes: list[tuple[int, int]], seed: int = 0, quality: int = 90) -> list[str]:
    """One JPEG per (height, width): smooth random colour fields (decode cost like photos, unlike noise)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, (h, w) in enumerate(sizes):
        small = rng.integers(0, 256, (max(h // 32, 2), max(w // 32, 2), 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((w, h), Image.BICUBIC)
        path = folder / f"img{i:05d}_{h}x{w}.jpg"
        image.save(path, quality=quality)
        paths.append(str(path))
    return paths


def hf_image_processor(model_type: str, config: dict, folder: pathlib.Path):
    """transformers' default image processor for `model_type`, built from a preprocessor config dict
    written to `folder` (no download)."""
    from transformers import AutoImageProcessor

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    (folder / "preprocessor_config.json").write_text(json.dumps(config))
    return AutoImageProcessor.from_pretrained(str(folder))


def wall_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median wall milliseconds of fn() with the device synchronised after each call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@contextlib.contextmanager
def eager(encoder):
    """The encoder's tower without torch.compile and CUDA graphs for a while (the eager rows)."""
    with encoder.graphs_off(), torch.compiler.set_stance("force_eager"):
        yield


@contextlib.contextmanager
def one_call(encoder):
    """`encode` without its smaller first tower call (first_chunk_patches = max_batch_patches)."""
    first, encoder.first_chunk_patches = encoder.first_chunk_patches, encoder.max_batch_patches
    try:
        yield
    finally:
        encoder.first_chunk_patches = first


@contextlib.contextmanager
def growth(encoder, factor: float):
    """`encode` with another chunk_growth for a while (math.inf: the first chunk, then max_batch_patches)."""
    old, encoder.chunk_growth = encoder.chunk_growth, factor
    try:
        yield
    finally:
        encoder.chunk_growth = old


def has_eager_rows(encoder) -> bool:
    """Eager rows beside the compiled/graph ones: the tower runs in this process and is not eager already."""
    return encoder.tensor_parallel_size == 1 and (encoder.mm_config.compile or encoder.mm_config.cuda_graphs)


def run_workload(name: str, encoder, paths: list[str], hf_proc, hf_tower, warmup: int, iters: int) -> tuple[list, dict]:
    """Rows for one workload and its summary (preprocessing share, pixel parity with transformers)."""
    device, n = encoder.device, len(paths)
    rows = [E2ERow(name, "mmenc encode(files)", n, wall_ms(lambda: encoder.encode(paths), device, warmup, iters))]
    with one_call(encoder):
        rows.append(E2ERow(name, "mmenc encode(files) 1 call", n,
                           wall_ms(lambda: encoder.encode(paths), device, warmup, iters)))
    with growth(encoder, math.inf):
        rows.append(E2ERow(name, "mmenc encode(files) first+rest", n,
                           wall_ms(lambda: encoder.encode(paths), device, warmup, iters)))
    with TowerTrace(encoder) as trace:  # one more call of the default schedule, traced: where its time goes
        encoder.encode(paths)
    pre_ms = wall_ms(lambda: encoder.preprocessor.run(paths), device, warmup, iters)
    rows.append(E2ERow(name, "mmenc preprocess only", n, pre_ms))
    pixel_values, grid_thw, _ = encoder.preprocessor.run(paths)
    rows.append(E2ERow(name, "mmenc tower only", n,
                       time_ms(lambda: encoder.encode_pixels(pixel_values, grid_thw), device, warmup, iters)))
    if has_eager_rows(encoder):
        with eager(encoder):
            rows.append(E2ERow(name, "mmenc encode(files) eager", n,
                               wall_ms(lambda: encoder.encode(paths), device, warmup, iters)))
            rows.append(E2ERow(name, "mmenc tower only eager", n,
                               time_ms(lambda: encoder.encode_pixels(pixel_values, grid_thw), device, warmup, iters)))
    summary = {"workload": name, "images": n, "preprocess_share": pre_ms / rows[0].ms, "encode_trace": trace.report(),
               "grid_rows": grid_thw.tolist()}
    if hf_proc is not None and (why := hf_rows_unavailable(hf_proc, paths[:1], hf_tower)):
        summary["transformers_skipped"] = why
    elif hf_proc is not None:
        from PIL import Image

        def hf_inputs():
            return hf_proc(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")

        def hf_pixels():
            out = hf_inputs()
            return out["pixel_values"], out["image_grid_thw"]

        def hf_e2e():
            if not grid_layout:  # tiles with image sizes, or whole images: the reference's own call
                return hf_tower.from_processor(hf_inputs())
            pv, grid = hf_pixels()
            return hf_tower(pv.to(device=device, dtype=encoder.dtype, non_blocking=True), grid)

        grid_layout = "image_grid_thw" in hf_inputs()
        same_work = True
        if grid_layout:
            ref_pv, ref_grid = hf_pixels()
            summary["grids_equal_transformers"] = same_work = (
                torch.equal(ref_grid.cpu(), grid_thw.cpu()) and ref_pv.shape == pixel_values.shape)
            if same_work:
                summary["pixels_max_diff_vs_transformers"] = float(
                    (pixel_values.float().cpu().reshape(ref_pv.shape) - ref_pv.float()).abs().max())
            elif hf_tower is not None:
                summary["transformers_skipped"] = (
                    f"transformers' processor gives pixel_values {tuple(ref_pv.shape)} and grids "
                    f"{ref_grid.tolist()[:3]}, mmenc's {tuple(pixel_values.shape)} and {grid_thw.tolist()[:3]}: the "
                    f"two processors' settings differ (a checkpoint folder's preprocessor_config.json sets both)")
        elif hf_tower is not None:  # no grid to compare: the embedding rows each side yields
            ours = sum(encoder.output_tokens(grid_thw))
            try:
                theirs = str(hf_e2e().shape[0])
            except (RuntimeError, ValueError) as e:  # e.g. tiles of another size than its tower's
                theirs = f"an error ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            summary["tokens_equal_transformers"] = same_work = theirs == str(ours)
            if not same_work:
                summary["transformers_skipped"] = (
                    f"transformers' processor + tower give {theirs} embedding rows for these files, mmenc {ours}: "
                    f"the two processors' settings differ (a checkpoint folder's preprocessor_config.json sets both)")
        if hf_tower is not None and same_work:
            rows.append(E2ERow(name, "transformers proc+tower", n, wall_ms(hf_e2e, device, warmup, iters)))
        rows.append(E2ERow(name, "transformers proc only", n, wall_ms(hf_inputs, device, warmup, iters)))
    return rows, summary


def hf_rows_unavailable(hf_proc, paths: list[str], hf_tower=None) -> str | None:
    """None when transformers' rows can run: its processor answers in the grid layout its tower takes
    (pixel_values + image_grid_thw: the Qwen lineage and the other grid families), or the reference calls the
    processor's output itself (`from_processor`: the LLaVA-style families, mmenc/bench/hf_vlm.py). Else the
    reason; those rows are then left out, mmenc's are not."""
    from PIL import Image

    out = hf_proc(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
    if "image_grid_thw" in out or (hasattr(hf_tower, "from_processor") and "pixel_values" in out):
        return None
    return (f"{type(hf_proc).__name__} answers {sorted(out.keys())}, not pixel_values + image_grid_thw, and "
            f"transformers' reference here does not call that output itself")


def run_stream(encoder, pool: list[str], count: int) -> dict:
    """`count` images cycling over the files of `pool` through encode_iter (after one warm-up pass over
    the pool): images/s, the tower's time (CUDA events around each tower call) over the wall time, the
    gaps between tower calls, host seconds and graph paths (mmenc.bench.trace), and the tower alone
    over the same packings (`tower_only_ms`): the rate the stream should reach."""
    for _ in encoder.encode_iter(pool):  # warm-up: every size once (compile, kernels, page cache)
        pass
    done = failed = 0
    with TowerTrace(encoder) as trace:
        for _, value in encoder.encode_iter(itertools.islice(itertools.cycle(pool), count)):
            done += isinstance(value, torch.Tensor)
            failed += not isinstance(value, torch.Tensor)
    report = trace.report()
    wall_s, tower_s = trace.wall_s, report["tower_ms"] / 1e3
    same_s = tower_only_ms(encoder, trace.grids(), encoder.loaded.config.patch_features) / 1e3
    return {"images": done, "failed": failed, "distinct_files": len(pool), "tower_calls": report["tower_calls"],
            "wall_s": wall_s, "tower_s": tower_s, "images_per_s": done / wall_s,
            "tower_only_images_per_s": done / max(tower_s, 1e-9), "gpu_busy_fraction": tower_s / wall_s,
            "tower_same_packings_s": same_s, "vs_tower_same_packings": same_s / wall_s,
            "graph_calls": report.get("graph_calls"), "trace": report}


def invariance_probe(encoder, small: tuple[int, int, int], large: tuple[int, int, int], seed: int = 0) -> dict:
    """Largest |difference| of one image's embedding (grid `small`) encoded alone vs in mixed batches:
    with another small image (after it, before it) and with a `large` one (before, after)."""
    features = encoder.loaded.config.patch_features
    gen = torch.Generator().manual_seed(seed)

    def pixels(grid):
        return torch.randn(int(np.prod(grid[:3])), features, generator=gen)  # anyres rows: (tiles, s, s, H, W)

    me, other, big = pixels(small), pixels(small), pixels(large)
    tokens = encoder.output_tokens(torch.tensor([small]))[0]
    alone = encoder.encode_pixels(me, torch.tensor([small])).float()
    cases = {"with a small image, first": ([me, other], [small, small], 0),
             "with a small image, second": ([other, me], [small, small], 1),
             "with a large image, first": ([me, big], [small, large], 0),
             "with a large image, second": ([big, me], [large, small], 1)}
    diffs = {}
    for label, (pvs, grids, position) in cases.items():
        out = encoder.encode_pixels(torch.cat(pvs), torch.tensor(grids)).float()
        first = 0 if position == 0 else encoder.output_tokens(torch.tensor(grids[:1]))[0]
        diffs[label] = float((out[first:first + tokens] - alone).abs().max())
    return {"small_grid": list(small), "large_grid": list(large), "max_abs_diff": diffs,
            "max_abs_diff_overall": max(diffs.values()), "max_abs_value": float(alone.abs().max())}


def format_rows(rows: list[E2ERow]) -> str:
    """The table; "vs tower": an encode row's images/s over the tower-only row of the same mode."""
    head = f"{'workload':<14} {'impl':<31} {'ms':>9} {'img/s':>9} {'vs HF':>6} {'vs tower':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        same = {x.impl: x for x in rows if x.workload == r.workload}
        hf = same.get("transformers proc+tower")
        encode = r.impl.startswith("mmenc encode(files)")
        tower = same.get("mmenc tower only eager" if r.impl.endswith(" eager") else "mmenc tower only")
        vs_hf = f"{hf.ms / r.ms:.2f}x" if hf is not None and encode else "-"
        vs_tower = f"{100 * tower.ms / r.ms:.0f}%" if tower is not None and encode else "-"
        lines.append(f"{r.workload:<14} {r.impl:<31} {r.ms:>9.2f} {r.images_per_s:>9.1f} {vs_hf:>6} {vs_tower:>8}")
    return "\n".join(lines)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
