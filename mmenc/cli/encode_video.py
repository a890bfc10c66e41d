"""`mmenc encode` for video files: the sampling flags, and each video's embeddings with its metadata.

For each video PATH the output file holds `PATH` (embeddings [tokens, hidden], all temporal units in
order), `PATH.grid_thw` ([rows, 3]: one row, or one per 4-frame chunk for Kimi), `PATH.frames_indices`
(int64, the sampled frames), `PATH.timestamps` (float64 seconds per temporal unit, for families whose
prompt carries them) and the whole VideoInfo as JSON in the file's metadata under `video:PATH`
(second_per_grid_ts, fps, duration, ...). Progress counts sampled frames."""
import argparse
import json

import torch

from mmenc.preprocess.video_decode import VIDEO_EXTENSIONS  # noqa: F401  (encode.py's folder expansion)


def add_video_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("video inputs (.mp4, .mkv, .webm, .mov, ...; pip install 'mmenc[video]')")
    g.add_argument("--fps", type=float, default=None, metavar="F",
                   help="sample F frames per second (default: the model's video processor: e.g. every frame for "
                        "Qwen2/2.5-VL, 2 fps for Qwen3-VL, GLM-4.1V, Kimi-K2.5)")
    g.add_argument("--num-frames", type=int, default=None, metavar="N", help="sample N frames, evenly (instead of --fps)")
    g.add_argument("--min-frames", type=int, default=None, metavar="N",
                   help="with --fps: at least N frames (Qwen families; default: the processor's, 4)")
    g.add_argument("--max-frames", type=int, default=None, metavar="N",
                   help="with --fps: at most N frames (Qwen families; default: the processor's, 768)")


def video_options(args: argparse.Namespace):
    from mmenc.preprocess.video_sampling import VideoOptions

    return VideoOptions(fps=args.fps, num_frames=args.num_frames, min_frames=args.min_frames,
                        max_frames=args.max_frames)


def planned_frames(encoder, path: str, options) -> int:
    """Frames the video will contribute (for the progress total); 0 when it cannot be planned (the
    pipeline then reports why)."""
    from mmenc.preprocess.video_decode import probe

    if encoder.video_processor is None:
        return 0
    try:
        return len(encoder.video_processor.plan(probe(path, path), options, path).indices)
    except (ValueError, ImportError):
        return 0


def encode_videos(encoder, paths: list[str], options, results, progress) -> None:
    """Every video through encode_iter (pieces streamed through the tower, bounded memory); results get
    the tensors and metadata described in the module docstring; a video that fails is named and skipped."""
    from mmenc.preprocess import LoadFailure
    from mmenc.preprocess.video import Video

    base = encoder.tally.snapshot().get("video_frames", 0)
    progress.count = lambda: progress.done + int(encoder.tally.snapshot().get("video_frames", 0) - base)
    for index, out in encoder.encode_iter([Video(p, **options.as_dict()) for p in paths]):
        path = paths[index]
        if isinstance(out, LoadFailure):
            results.fail(out.message)
            continue
        info = out.video
        results.tensors[path] = out.embeddings.float().cpu().contiguous()
        results.tensors[f"{path}.grid_thw"] = torch.tensor(info.grid_thw, dtype=torch.int64)
        results.tensors[f"{path}.frames_indices"] = torch.tensor(info.frames_indices, dtype=torch.int64)
        if info.timestamps is not None:
            results.tensors[f"{path}.timestamps"] = torch.tensor(info.timestamps, dtype=torch.float64)
        results.metadata[f"video:{path}"] = json.dumps(info.as_dict())
        results.tokens += out.embeddings.shape[0]
        results.images += 1
        results.videos += 1
