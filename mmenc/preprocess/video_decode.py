"""Video files -> metadata and RGB frames, with PyAV (FFmpeg in its wheels; the `video` extra).

    meta = probe("clip.mp4")                       # VideoMetadata: frames, fps, duration, size
    frames = decode("clip.mp4", [0, 15, 30], meta)  # uint8 [3, H, W, 3], RGB

What a frame index means: the i-th frame in presentation order, counting from the first, as
transformers' PyAV reader counts them (it decodes from the start and keeps the frames whose count is
sampled). `decode` seeks instead: it jumps to the key frame before the first wanted frame and decodes
from there, numbering each frame by its presentation time x the stream's average rate (rounded). On
a constant-rate stream that is the count; a decoded span whose numbers do not step by one (variable
frame rate, broken timestamps) is decoded again from the start and counted, so the frames are the
counting reader's in every case. The metadata follows that reader too: `total_num_frames` is the
container's frame count (Matroska/WebM have none: the packets are counted), `fps` its average rate,
`duration` = frames / fps.

Errors are `VideoDecodeError` (an ImageLoadError, so a per-item failure in the pipeline), naming the
input and the frame and time where decoding failed.
"""
import dataclasses
import io
import os
import pathlib
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from mmenc.preprocess.images import ImageLoadError

VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv",
                              ".3gp", ".ogv", ".wmv"})


class VideoDecodeError(ImageLoadError):
    """A video could not be opened or decoded; the message names it and the frame/time."""


@dataclasses.dataclass(frozen=True)
class VideoMetadata:
    """What sampling needs to know of a video (transformers' VideoMetadata fields).

    total_num_frames: frames in the stream; fps: its average rate (None if the container has none);
    duration: seconds (total_num_frames / fps); height, width: decoded frame size."""

    total_num_frames: int
    fps: float | None
    duration: float | None
    height: int
    width: int
    backend: str = "pyav"

    def __post_init__(self):
        if self.total_num_frames < 1:
            raise ValueError(f"total_num_frames={self.total_num_frames} must be >= 1")


def av_module():
    """PyAV, or ImportError saying how to install it."""
    try:
        import av
    except ImportError as e:
        raise ImportError("decoding video needs PyAV: pip install 'mmenc[video]' (or pip install av)") from e
    return av


def video_signature(data: bytes | bytearray | memoryview) -> bool:
    """Encoded bytes that start like a video container (MP4/MOV, Matroska/WebM, AVI, MPEG-TS/PS, FLV, Ogg)."""
    head = bytes(data[:16])
    return (head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide") or head[:4] == b"\x1a\x45\xdf\xa3"
            or (head[:4] == b"RIFF" and head[8:12] == b"AVI ") or head[:4] in (b"\x00\x00\x01\xba", b"FLV\x01")
            or head[:4] == b"OggS" and b"theora" in bytes(data[:64]) or (len(head) > 0 and head[0] == 0x47
                                                                          and len(data) > 188 and data[188] == 0x47))


def looks_like_video(item: Any) -> bool:
    """A path with a video extension, or bytes with a video container's signature."""
    if isinstance(item, (str, os.PathLike)):
        return pathlib.Path(item).suffix.lower() in VIDEO_EXTENSIONS
    if isinstance(item, (bytes, bytearray, memoryview)):
        return video_signature(item)
    return False


def _open(source: Any, name: str):
    av = av_module()
    if isinstance(source, (str, os.PathLike)):
        path = pathlib.Path(source)
        if path.is_dir():
            raise VideoDecodeError(f"{name}: is a directory, expected a video file")
        if not path.exists():
            raise VideoDecodeError(f"{name}: cannot read file (no such file)")
        src = os.fspath(path)
    elif isinstance(source, (bytes, bytearray, memoryview)):
        if len(source) == 0:
            raise VideoDecodeError(f"{name}: empty video (0 bytes)")
        src = io.BytesIO(bytes(source))
    else:
        raise VideoDecodeError(f"{name}: unsupported video input {type(source).__name__}; pass a path or bytes")
    try:
        container = av.open(src)
    except (av.FFmpegError, OSError, ValueError) as e:
        raise VideoDecodeError(f"{name}: not a readable video ({e})") from e
    if not container.streams.video:
        container.close()
        raise VideoDecodeError(f"{name}: has no video stream")
    return container


def probe(source: Any, name: str = "video") -> VideoMetadata:
    """The video's metadata from its container header (no frame is decoded; Matroska/WebM, which
    store no frame count, have their packets counted)."""
    av = av_module()
    container = _open(source, name)
    try:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        frames = int(stream.frames or 0)
        if frames <= 0:
            try:
                frames = sum(1 for p in container.demux(stream) if p.size)
            except av.FFmpegError as e:
                raise VideoDecodeError(f"{name}: cannot read the video's packets ({e})") from e
        height, width = stream.codec_context.height, stream.codec_context.width
    finally:
        container.close()
    if frames <= 0 or not height or not width:
        raise VideoDecodeError(f"{name}: the video stream has no frames ({frames}) or no size ({width}x{height})")
    fps = float(rate) if rate else None
    return VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps if fps else None,
                         height=int(height), width=int(width))


def decode(source: Any, indices: Sequence[int], metadata: VideoMetadata, name: str = "video") -> np.ndarray:
    """The frames at `indices` (ascending, repeats allowed) -> RGB uint8 [len(indices), H, W, 3].
    Seeks to the key frame before the first one (see the module docstring)."""
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise ValueError("indices is empty; pass at least one frame index")
    if wanted[0] < 0 or wanted[-1] >= metadata.total_num_frames:
        raise ValueError(f"frame indices {wanted[0]}..{wanted[-1]} outside 0..{metadata.total_num_frames - 1}")
    got = _decode_seeking(source, wanted, metadata, name)
    if got is None:  # the timestamps do not number the frames: count them from the start
        got = _decode_counting(source, wanted, metadata, name)
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoDecodeError(f"{name}: the video ends before frame {missing[0]}{_at(missing[0], metadata)} "
                               f"(its header says {metadata.total_num_frames} frames)")
    return np.stack([got[int(i)] for i in indices])


def _at(index: int, metadata: VideoMetadata) -> str:
    return f" (t={index / metadata.fps:.3f} s)" if metadata.fps else ""


def _rgb(frame, metadata: VideoMetadata, index: int, name: str) -> np.ndarray:
    array = frame.to_ndarray(format="rgb24")
    if array.shape[:2] != (metadata.height, metadata.width):
        raise VideoDecodeError(f"{name}: frame {index}{_at(index, metadata)} is {array.shape[1]}x{array.shape[0]}, "
                               f"the stream's first is {metadata.width}x{metadata.height}; a video must keep its size")
    return array


def _decode_seeking(source: Any, wanted: list[int], metadata: VideoMetadata, name: str) -> dict[int, np.ndarray] | None:
    """Frames by index after one seek; None when the stream's timestamps do not number its frames."""
    av = av_module()
    container = _open(source, name)
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        rate, tb = stream.average_rate, stream.time_base
        if not rate or tb is None or stream.start_time is None:
            return None
        start = stream.start_time
        frame_pts = 1 / (Fraction(rate) * tb)  # pts units per frame
        if wanted[0] > 0:
            container.seek(int(start + wanted[0] * frame_pts), stream=stream, backward=True, any_frame=False)
        got: dict[int, np.ndarray] = {}
        previous, index = None, wanted[0]
        wanted_set, last = set(wanted), wanted[-1]
        try:
            for frame in container.decode(stream):
                if frame.pts is None:
                    return None
                index = round((frame.pts - start) / frame_pts)
                if (previous is not None and index != previous + 1) or (previous is None and index > wanted[0]):
                    return None  # not numbered by its timestamps, or the seek landed past the first frame
                previous = index
                if index in wanted_set:
                    got[index] = _rgb(frame, metadata, index, name)
                if index >= last:
                    break
        except av.FFmpegError as e:
            raise VideoDecodeError(f"{name}: cannot decode frame {index + 1}{_at(index + 1, metadata)} ({e})") from e
        return got
    finally:
        container.close()


def _decode_counting(source: Any, wanted: list[int], metadata: VideoMetadata, name: str) -> dict[int, np.ndarray]:
    """Frames by their count from the start (transformers' PyAV reader)."""
    av = av_module()
    container = _open(source, name)
    got: dict[int, np.ndarray] = {}
    index = -1
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        wanted_set, last = set(wanted), wanted[-1]
        for index, frame in enumerate(container.decode(stream)):
            if index in wanted_set:
                got[index] = _rgb(frame, metadata, index, name)
            if index >= last:
                break
    except av.FFmpegError as e:
        raise VideoDecodeError(f"{name}: cannot decode frame {index + 1}{_at(index + 1, metadata)} ({e})") from e
    finally:
        container.close()
    return got
