"""The frames of a video at given indices, by seeking, or by going on from where the video's previous
piece stopped.

    frames = decode("clip.mp4", [0, 15, 30], meta)   # RGB uint8 [3, H, W, 3]; meta: video_decode.probe
    cursors = DecodeCursors()                         # shared by the pieces of the videos being read
    decode(path, piece_frames, meta, name, cursors=cursors, key=(video_id, lane), keep=not lane_last)

What a frame index means: the i-th frame in presentation order, counting from the first, as
transformers' PyAV reader counts them (it decodes from the start and keeps the frames whose count is
sampled). `decode` seeks instead: it jumps to the key frame before the first wanted frame and decodes
from there, numbering each frame by its presentation time x the stream's average rate (rounded). On
a constant-rate stream that is the count; a decoded span whose numbers do not step by one (variable
frame rate, broken timestamps) is decoded again from the start and counted, so the frames are the
counting reader's in every case.

Cursors: a seek lands on the key frame before a piece, so pieces shorter than the key-frame interval
(often 250 frames, 8 s at 30 fps) decode the same frames again. With `cursors`, a video's open
decoder is kept after a piece (`keep`) and the next piece of the same `key` goes on from it when its
first frame is at most CONTINUE_SECONDS ahead; a piece whose video's decoder is in use by another
thread waits for it (the pieces of one key are then decoded one after the other, without repeats,
while other work, resize and patchify included, runs beside). A key is a video's decode lane
(VideoPiece.lane: a run of its pieces from a key frame on), so a long video's lanes decode in
parallel. Worker threads share one DecodeCursors; each worker process has its own (it pickles empty),
and a lane's pieces go to one worker process (mmenc.preprocess.procs)."""
import threading
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

from mmenc.preprocess.video_decode import (VideoDecodeError, VideoMetadata, av_module, open_container, rgb_frame,
                                           time_at)

SKIP_NONREF_CODECS = frozenset({"h264", "hevc"})  # decoders whose skip_frame=NONREF drops exactly the unreferenced frames
CONTINUE_SECONDS = 10.0  # go on decoding rather than seek when the next piece starts at most this far ahead
MAX_IDLE_CURSORS = 16  # open decoders kept between pieces (the oldest is closed beyond)


class _Cursor:
    """An open decoder: the frames still to come, how they are numbered, the last index decoded."""

    def __init__(self, source: Any, name: str, first: int, seek: bool):
        self.container = open_container(source, name)
        self.stream = self.container.streams.video[0]
        self.stream.thread_type = "AUTO"
        self.number = _pts_numbering(self.container, self.stream, first) if seek else None
        self.usable = self.number is not None or not seek
        self.previous: int | None = None  # last index decoded
        self.count = 0
        # frames timestamps number, not wanted, before the last wanted: their packets skip the decoder if nothing
        # refers to them (skip_frame NONREF); `skipped` remembers their indices, which then give no frame
        self.wanted: tuple[set[int], int] = (set(), -1)  # (indices wanted by the read in progress, its last)
        self.skipped: set[int] = set()
        self.skips = 0  # packets sent with NONREF
        skips = self.number is not None and self.stream.codec_context.name in SKIP_NONREF_CODECS
        self.frames = self._decode_skipping() if skips else self.container.decode(self.stream)

    def _decode_skipping(self):
        """container.decode(stream), but a packet of an unwanted frame before the read's last wanted one is
        decoded with skip_frame NONREF (a non-reference frame is then not decoded: no other frame depends
        on it, so the others' pixels are the same; about a third of an x264 stream's decoding time)."""
        ctx, mode = self.stream.codec_context, None
        for packet in self.container.demux(self.stream):
            index = self.number(packet) if packet.size else None  # packets carry the frame's pts
            wanted, last = self.wanted
            skip = index is not None and index < last and index not in wanted
            if ("NONREF" if skip else "DEFAULT") != mode:
                mode = ctx.skip_frame = "NONREF" if skip else "DEFAULT"
            if skip:
                self.skipped.add(index)
                self.skips += 1
            yield from packet.decode()

    def gap_skipped(self, index: int) -> bool:
        """Whether every frame between the previous one decoded and `index` was skipped (NONREF)."""
        gap = range(self.previous + 1, index)
        if not all(i in self.skipped for i in gap):
            return False
        self.skipped.difference_update(gap)
        return True

    def close(self) -> None:
        self.container.close()


def _pts_numbering(container, stream, first: int) -> Callable[[Any], int | None] | None:
    """Seek to the key frame before frame `first`; -> frame -> its index from its timestamp (None
    without one); None when the stream has no rate, time base or start time to number frames with."""
    rate, tb = stream.average_rate, stream.time_base
    if not rate or tb is None or stream.start_time is None:
        return None
    start, frame_pts = stream.start_time, 1 / (Fraction(rate) * tb)  # pts units per frame
    if first > 0:
        container.seek(int(start + first * frame_pts), stream=stream, backward=True, any_frame=False)
    return lambda frame: None if frame.pts is None else round((frame.pts - start) / frame_pts)


def _read(cursor: _Cursor, wanted: list[int], metadata: VideoMetadata, name: str) -> dict[int, np.ndarray] | None:
    """The frames at `wanted` from where the cursor is; None if its timestamps stop numbering the frames
    (or a fresh seek landed past the first wanted frame)."""
    av = av_module()
    got: dict[int, np.ndarray] = {}
    wanted_set, last = set(wanted), wanted[-1]
    cursor.wanted = (wanted_set, last)
    index = cursor.previous if cursor.previous is not None else wanted[0] - 1
    try:
        for frame in cursor.frames:
            if cursor.number is None:
                index, cursor.count = cursor.count, cursor.count + 1
            else:
                index = cursor.number(frame)
                if index is None or (index != cursor.previous + 1 and not cursor.gap_skipped(index)
                                     if cursor.previous is not None else index > wanted[0]):
                    return None
            cursor.previous = index
            cursor.skipped.discard(index)  # a reference frame asked to skip is decoded all the same
            if index in wanted_set:
                got[index] = rgb_frame(frame, metadata, index, name)
            if index >= last:
                break
    except av.FFmpegError as e:
        at = (index if index is not None else wanted[0] - 1) + 1
        raise VideoDecodeError(f"{name}: cannot decode frame {at}{time_at(at, metadata)} ({e})") from e
    return got


class DecodeCursors:
    """Open decoders of the videos being read piece by piece, by key (see the module docstring).
    Thread safe; a copy for another process (pickle) starts empty."""

    def __init__(self):
        self._cond = threading.Condition()
        self._idle: dict[Any, _Cursor] = {}
        self._busy: set = set()

    def checkout(self, key: Any) -> _Cursor | None:
        with self._cond:
            while key in self._busy:
                self._cond.wait()
            self._busy.add(key)
            return self._idle.pop(key, None)

    def checkin(self, key: Any, cursor: _Cursor | None, keep: bool) -> None:
        closing = []
        with self._cond:
            self._busy.discard(key)
            if cursor is not None and keep:
                self._idle[key] = cursor
                while len(self._idle) > MAX_IDLE_CURSORS:
                    closing.append(self._idle.pop(next(iter(self._idle))))
            elif cursor is not None:
                closing.append(cursor)
            self._cond.notify_all()
        for c in closing:
            c.close()

    def clear(self) -> None:
        """Close the decoders kept for pieces that did not come (a consumer that stopped early)."""
        with self._cond:
            idle, self._idle = list(self._idle.values()), {}
        for c in idle:
            c.close()

    def __getstate__(self):
        return {}

    def __setstate__(self, state):
        self.__init__()


def decode(source: Any, indices: Sequence[int], metadata: VideoMetadata, name: str = "video", *,
           cursors: DecodeCursors | None = None, key: Any = None, keep: bool = False) -> np.ndarray:
    """The frames at `indices` (ascending, repeats allowed) -> RGB uint8 [len(indices), H, W, 3]; with
    cursors and key, going on from the video's previous piece where that is cheaper than a seek, and
    keeping the decoder for its next piece when `keep`."""
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise ValueError("indices is empty; pass at least one frame index")
    if wanted[0] < 0 or wanted[-1] >= metadata.total_num_frames:
        raise ValueError(f"frame indices {wanted[0]}..{wanted[-1]} outside 0..{metadata.total_num_frames - 1}")
    cursor = cursors.checkout(key) if cursors is not None and key is not None else None
    got = None
    try:
        ahead = int(CONTINUE_SECONDS * (metadata.fps or 30))
        if cursor is not None and cursor.previous is not None and 0 <= wanted[0] - cursor.previous - 1 <= ahead:
            got = _read(cursor, wanted, metadata, name)
        for seek in (True, False):  # a fresh seek; failing that, count from the start
            if got is not None:
                break
            if cursor is not None:
                cursor.close()
            cursor = _Cursor(source, name, wanted[0], seek)
            got = _read(cursor, wanted, metadata, name) if cursor.usable else None
    except BaseException:
        keep = False
        raise
    finally:
        if cursors is not None and key is not None:
            cursors.checkin(key, cursor, keep)
        elif cursor is not None:
            cursor.close()
    missing = [i for i in wanted if i not in got]
    if missing:
        raise VideoDecodeError(f"{name}: the video ends before frame {missing[0]}{time_at(missing[0], metadata)} "
                               f"(its header says {metadata.total_num_frames} frames)")
    return np.stack([got[int(i)] for i in indices])
