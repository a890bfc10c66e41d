"""Video files -> metadata and RGB frames, with PyAV (FFmpeg in its wheels; the `video` extra).

    meta = probe("clip.mp4")                       # VideoMetadata: frames, fps, duration, size
    (frames: mmenc.preprocess.video_frames.decode)

The metadata follows transformers' PyAV reader: `total_num_frames` is the container's frame count
(Matroska/WebM have none: the packets are counted), `fps` its average rate, `duration` = frames / fps.

Errors are `VideoDecodeError` (an ImageLoadError, so a per-item failure in the pipeline), naming the
input and the frame and time where decoding failed.
"""
import dataclasses
import io
import os
import pathlib
from typing import Any

import numpy as np

from mmenc.preprocess.images import ImageLoadError, size_text

VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".mpg", ".mpeg", ".ts", ".flv",
                              ".3gp", ".ogv", ".wmv"})


class VideoDecodeError(ImageLoadError):
    """A video could not be opened or decoded; the message names it and the frame/time."""


@dataclasses.dataclass(frozen=True)
class VideoMetadata:
    """What sampling needs to know of a video (transformers' VideoMetadata fields).

    total_num_frames: frames in the stream; fps: its average rate (None if the container has none);
    duration: seconds (total_num_frames / fps); height, width: decoded frame size; keyframes: where
    the container's index has key frames, as frame indices (from their decode timestamps, so up to the
    stream's reordering depth early; () without an index): where a video's decode lanes can start."""

    total_num_frames: int
    fps: float | None
    duration: float | None
    height: int
    width: int
    backend: str = "pyav"
    keyframes: tuple[int, ...] = ()

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


def open_container(source: Any, name: str):
    """av.open of a path or bytes, with its first video stream checked; VideoDecodeError naming `name`."""
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
    container = open_container(source, name)
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
        keyframes = index_keyframes(stream)
    finally:
        container.close()
    if frames <= 0 or not height or not width:
        raise VideoDecodeError(f"{name}: the video stream has no frames ({frames}) or no size ({size_text(width, height)})")
    fps = float(rate) if rate else None
    return VideoMetadata(total_num_frames=frames, fps=fps, duration=frames / fps if fps else None,
                         height=int(height), width=int(width), keyframes=keyframes)


def index_keyframes(stream) -> tuple[int, ...]:
    """Frame indices of the key frames in the container's index (MP4/MOV sample tables, Matroska cues;
    nothing is read or decoded), ascending; () without an index, a rate or a time base."""
    rate, tb, start = stream.average_rate, stream.time_base, stream.start_time
    if not rate or tb is None:
        return ()
    try:
        entries = stream.index_entries
        stamps = [e.timestamp for e in entries if e.is_keyframe]
    except (AttributeError, TypeError):  # an older PyAV without index_entries
        return ()
    per_frame = 1 / (float(rate) * float(tb))  # timestamp units per frame
    return tuple(sorted({max(0, round((t - (start or 0)) / per_frame)) for t in stamps}))


def time_at(index: int, metadata: VideoMetadata) -> str:
    """" (t=1.234 s)" for a frame index, "" without a frame rate."""
    return f" (t={index / metadata.fps:.3f} s)" if metadata.fps else ""


def rgb_frame(frame, metadata: VideoMetadata, index: int, name: str) -> np.ndarray:
    """A decoded PyAV frame -> RGB uint8 [H, W, 3] (transformers' PyAV conversion); VideoDecodeError if
    its size is not the stream's."""
    array = frame.to_ndarray(format="rgb24")
    if array.shape[:2] != (metadata.height, metadata.width):
        raise VideoDecodeError(f"{name}: frame {index}{time_at(index, metadata)} is {size_text(array.shape[1], array.shape[0])}, "
                               f"the stream's first is {size_text(metadata.width, metadata.height)}; a video must keep its size")
    return array


