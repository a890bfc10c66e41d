"""`mmenc bench --video`: video files to embeddings, against the tower alone and transformers.

It writes its own H.264 clip with PyAV (default 60 s of 1280x720 at 30 fps; nothing is downloaded)
and times, at `--video-fps` (default 2) sampling, for one clip and for a batch of `--video-batch`
(default 16) of them:

  encode(files)        Encoder.encode([Video(clip, fps=F)] * n): decode (seeking, in the preprocessing
                       workers), resize, patchify, the tower, in pieces that stream
  preprocess only      the same pipeline with no tower (its wall time / encode's = the decode share)
  tower alone          encode_pixels over the same pixel_values, already on the device, in the same
                       per-piece grid rows (the rate encode should reach)
  transformers         its PyAV reader (decoding from the start), its video processor, its tower
                       (needs torchvision; skipped without it)

and the peak device memory of encode beyond its outputs, for clips of several lengths (flat in the
video's length: pieces stream). Frames/s count sampled frames. Per row also: for encode, the share of
its wall time the calling thread waited for the preprocessing workers (the decode share the tower sees;
0% when preprocessing keeps ahead), and on CUDA the row's peak device memory.
"""
import dataclasses
import json
import pathlib
import sys
import time

import torch

from mmenc.bench.e2e import wall_ms
from mmenc.preprocess.video import Video
from mmenc.preprocess.video_decode import probe
from mmenc.preprocess.video_sampling import VideoOptions


@dataclasses.dataclass
class VideoRow:
    """One measurement. wait_share: of the timed calls' wall time, the share the calling thread sat
    waiting for the preprocessing workers (decode, resize) or staging a chunk (Encoder tally chunk_wait_s;
    encode rows only); peak_gib: device memory at its peak during the row's calls beyond what was
    allocated before them (CUDA only)."""

    name: str
    impl: str
    ms: float
    frames: int
    wait_share: float | None = None
    peak_gib: float | None = None

    @property
    def frames_per_s(self) -> float:
        return self.frames / max(self.ms / 1000, 1e-9)


def write_bench_clip(path: pathlib.Path, seconds: float, size: tuple[int, int], rate: int = 30) -> pathlib.Path:
    """An H.264 MP4 (x264 veryfast, its default GOP), a moving pattern with noise; kept if it exists."""
    from mmenc.testing.clips import write_clip

    if not path.exists():
        write_clip(path, frames=int(seconds * rate), size=size, fps=rate, codec="libx264", seed=1)
    return path


def tower_inputs(encoder, clip, options: VideoOptions, n: int):
    """The video's pixel_values on the device and its per-piece grid rows, n times (the tower-alone input)."""
    vp = encoder.video_processor
    plan = vp.plan(probe(clip), options)
    pieces = vp.pieces(clip, "clip", plan, encoder.preprocessor.video_piece_patches or encoder.max_batch_patches // 4)
    pixel_values, grid = vp.finish([vp.prepare_piece(p) for p in pieces], [p.plan for p in pieces])
    pixel_values = pixel_values.reshape(pixel_values.shape[0], -1).to(encoder.device, encoder.dtype)
    return torch.cat([pixel_values] * n), torch.cat([grid] * n), len(plan.indices)


def preprocess_only(encoder, items) -> None:
    for _ in encoder.preprocessor.iter_chunks(items, schedule=encoder.chunk_schedule, errors="raise"):
        pass


def run_video(encoder, hf_tower, *, seconds: float, size: tuple[int, int], fps: float, batch: int,
              lengths: list[float], folder: pathlib.Path, warmup: int, iters: int,
              json_path: str | None = None) -> list[VideoRow]:
    """The measurements described in the module docstring; prints a table, returns its rows."""
    if encoder.video_processor is None:
        raise ValueError(f"{encoder.model_name!r} takes no video; pick a video family (Qwen2/2.5/3-VL, GLM-4.1V, ...)")
    device, options = encoder.device, VideoOptions(fps=fps)
    clip = write_bench_clip(folder / f"bench-{int(seconds)}s-{size[1]}x{size[0]}.mp4", seconds, size)
    rows: list[VideoRow] = []
    hf_call = hf_callable(hf_tower, encoder, clip, options)

    def timed(name: str, impl: str, fn, frames: int, warm: int, timed_calls: int) -> None:
        calls: list[tuple[float, float]] = []  # (chunk_wait_s, wall s) per call

        def call():
            before, start = encoder.tally.snapshot(), time.perf_counter()
            fn()
            calls.append((encoder.tally.since(before).get("chunk_wait_s", 0.0), time.perf_counter() - start))

        base = _reset_peak(device)
        ms = wall_ms(call, device, warm, timed_calls)
        waited = calls[warm:] or calls
        share = sum(w for w, _ in waited) / max(sum(t for _, t in waited), 1e-9) if impl == "mmenc encode(files)" \
            else None
        rows.append(VideoRow(name, impl, ms, frames, share, _peak_gib(device, base)))
        extra = (f", waiting for preprocessing {share:.0%}" if share is not None else "") + (
            f", peak {rows[-1].peak_gib:.3f} GiB" if rows[-1].peak_gib is not None else "")
        print(f"mmenc bench --video: {name}, {impl}: {rows[-1].ms:.1f} ms ({rows[-1].frames_per_s:.1f} frames/s{extra})",
              file=sys.stderr, flush=True)
        write_json(json_path, rows, {})

    for n in (1, batch):
        name = f"{n}x{seconds:g}s {size[1]}x{size[0]} @{fps:g}fps"
        items = [Video(clip, fps=fps)] * n
        pixel_values, grid, frames = tower_inputs(encoder, clip, options, n)
        frames *= n
        timed(name, "mmenc encode(files)", lambda: encoder.encode(items), frames, warmup, iters)
        timed(name, "mmenc preprocess only", lambda: preprocess_only(encoder, items), frames, warmup, iters)
        timed(name, "mmenc tower alone", lambda: encoder.encode_pixels(pixel_values, grid), frames, warmup, iters)
        del pixel_values
        if isinstance(hf_call, str):
            print(f"mmenc bench --video: transformers skipped: {hf_call}", file=sys.stderr)
        else:
            # one clip at a time, as its processor + tower would serve them; the batch case comes warm from
            # the single-clip case, so it is timed without a warm-up call of its own
            timed(name, "transformers processor + tower", lambda: [hf_call() for _ in range(n)], frames,
                  min(warmup, 1) if n == 1 else 0, max(1, iters // 3))
    peaks = memory_by_length(encoder, lengths, size, fps, folder) if device.type == "cuda" else {}
    print(format_video(rows, peaks))
    write_json(json_path, rows, peaks)
    return rows


def _reset_peak(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gib(device: torch.device, base: int | None) -> float | None:
    if base is None:
        return None
    torch.cuda.synchronize(device)
    return round((torch.cuda.max_memory_allocated(device) - base) / 2 ** 30, 3)


def write_json(json_path: str | None, rows: list[VideoRow], peaks: dict) -> None:
    """The rows so far (written after each, so a run cut short keeps what it measured)."""
    if json_path:
        pathlib.Path(json_path).write_text(json.dumps({"rows": [dict(dataclasses.asdict(r), frames_per_s=r.frames_per_s)
                                                                for r in rows], "peak_gib_by_seconds": peaks}, indent=1))


def hf_callable(hf_tower, encoder, clip, options: VideoOptions):
    """transformers' side: () -> embeddings of one clip (its PyAV reader, its video processor, its tower),
    or the reason it cannot run."""
    try:
        import torchvision  # noqa: F401
        from transformers.video_utils import load_video
    except ImportError as e:
        return f"transformers' video processors need torchvision ({e})"
    if hf_tower is None:
        return "no transformers tower for this model"
    from mmenc.testing.hf_video import hf_processor, quiet_kwargs

    proc, extra = hf_processor(encoder.video_processor.kind, encoder.loaded.video_config)

    def sample(metadata, **_):
        return proc.sample_frames(metadata, fps=options.fps)

    def call():
        frames, metadata = load_video(str(clip), backend="pyav", sample_indices_fn=sample)
        out = proc(videos=[frames], do_sample_frames=False, return_tensors="pt", **extra, **quiet_kwargs(proc))
        pv = out["pixel_values_videos"].to(encoder.device, encoder.dtype)
        return hf_tower(pv, out["video_grid_thw"])

    return call


def memory_by_length(encoder, lengths: list[float], size, fps: float, folder: pathlib.Path) -> dict:
    """Peak device GiB of one encode beyond the embeddings it returns, per clip length (seconds)."""
    peaks = {}
    for seconds in lengths:
        clip = write_bench_clip(folder / f"bench-{int(seconds)}s-{size[1]}x{size[0]}.mp4", seconds, size)
        peaks[seconds] = peak_beyond_output(encoder, clip, fps)
    return peaks


WARM_ENCODES = 2  # before the measured one: the first runs each packing eagerly, the second captures its graph


def peak_beyond_output(encoder, clip, fps: float) -> float:
    """Peak device GiB of one encode of `clip` beyond the embeddings it returns, after WARM_ENCODES of it
    (compile done and, with CUDA graphs, every packing's graph captured: a capture's pool is memory the
    first sightings allocate once, not memory that grows with the video)."""
    for _ in range(WARM_ENCODES):
        encoder.encode([Video(clip, fps=fps)])
    torch.cuda.synchronize(encoder.device)
    torch.cuda.reset_peak_memory_stats(encoder.device)
    base = torch.cuda.memory_allocated(encoder.device)
    (out,) = encoder.encode([Video(clip, fps=fps)])
    torch.cuda.synchronize(encoder.device)
    held = out.embeddings.numel() * out.embeddings.element_size()
    return round((torch.cuda.max_memory_allocated(encoder.device) - base - held) / 2 ** 30, 3)


def format_video(rows: list[VideoRow], peaks: dict) -> str:
    lines = [f"{'workload':<32} {'impl':<32} {'ms':>10} {'frames/s':>10} {'vs tower':>9} {'wait':>5} {'peak GiB':>9}"]
    tower = {r.name: r.ms for r in rows if r.impl == "mmenc tower alone"}
    for r in rows:
        ratio = f"{tower[r.name] / r.ms:.2f}" if r.name in tower and r.impl != "mmenc tower alone" else ""
        wait = f"{r.wait_share:.0%}" if r.wait_share is not None else ""
        peak = f"{r.peak_gib:.3f}" if r.peak_gib is not None else ""
        lines.append(f"{r.name:<32} {r.impl:<32} {r.ms:>10.1f} {r.frames_per_s:>10.1f} {ratio:>9} {wait:>5} {peak:>9}")
    lines.append("wait: share of encode's wall time its calling thread waited for the preprocessing workers (decode, "
                 "resize) or staged a chunk; peak GiB: device memory beyond what was allocated before the row")
    for name in tower:
        by = {r.impl: r.ms for r in rows if r.name == name}
        encode = by.get("mmenc encode(files)")
        line = f"{name}: encode at {tower[name] / encode:.0%} of the tower alone (target >= 90%)"
        if "transformers processor + tower" in by:
            line += f", {by['transformers processor + tower'] / encode:.1f}x transformers (target >= 5x)"
        lines.append(line + f", preprocessing alone {by['mmenc preprocess only'] / encode:.0%} of encode's wall time")
    for seconds, gib in peaks.items():
        lines.append(f"peak device memory beyond the outputs, one {seconds:g} s clip: {gib:.3f} GiB")
    return "\n".join(lines)
