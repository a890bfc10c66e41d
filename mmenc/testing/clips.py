"""Synthetic video clips encoded with PyAV, for tests and benchmarks (nothing is downloaded).

    path = write_clip(tmp_path / "a.mp4", frames=40, size=(48, 64), fps=10)   # H.264 in MP4
    write_clip(tmp_path / "a.webm", codec="libvpx-vp9", ...)                 # VP9 in WebM

Each frame is a moving colour pattern plus noise (seeded), so resizing and patch order are exercised
and frames differ from each other (a wrong frame index changes the pixels)."""
import pathlib

import numpy as np

# (container suffix, encoder) pairs PyAV's wheels encode quickly; x265 and AV1 are slow and log a lot
FAST_CODECS = ((".mp4", "libx264"), (".webm", "libvpx-vp9"), (".mkv", "mpeg4"), (".mov", "libx264"),
               (".avi", "mpeg4"))


def clip_frame(i: int, height: int, width: int, seed: int = 0) -> np.ndarray:
    """Frame i of the test pattern: RGB uint8 [height, width, 3]."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed * 100003 + i)
    frame = np.stack([(x * 5 + i * 9) % 256, (y * 7 + i * 4) % 256, ((x + y) * 3 + i * 13) % 256], axis=-1)
    return np.clip(frame + rng.integers(-20, 21, frame.shape), 0, 255).astype(np.uint8)


def write_clip(path, *, frames: int = 24, size: tuple[int, int] = (48, 64), fps: int = 10, codec: str = "libx264",
               gop: int | None = None, seed: int = 0, options: dict | None = None) -> pathlib.Path:
    """Encode `frames` frames of `size` (height, width; even) at `fps` into `path` (the container from its
    suffix); gop: key frame interval (the encoder's default if None). Returns the path."""
    import av

    path = pathlib.Path(path)
    height, width = size
    container = av.open(str(path), "w")
    try:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        opts = dict(options or {})
        if gop is not None:
            stream.codec_context.gop_size = gop
        if codec.startswith("libx26"):  # veryfast keeps B-frames (reordering: what seeking must get right)
            opts.setdefault("preset", "veryfast")
            if codec == "libx265":
                opts.setdefault("x265-params", "log-level=error")
        stream.options = opts
        for i in range(frames):
            frame = av.VideoFrame.from_ndarray(clip_frame(i, height, width, seed), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    finally:
        container.close()
    return path
