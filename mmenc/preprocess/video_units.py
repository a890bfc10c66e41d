"""Videos among a stream of inputs: each becomes the VideoPieces the pipeline's workers prepare
(mmenc.preprocess.pipeline), in input order, and a video that fails is reported once.

    units = VideoUnits(video_processor, piece_patches=16384)
    for index, unit in units.expand(items): ...   # an image as given; a video's pieces; or its LoadFailure
    units.skip(result)                            # True for what follows a failed video's first failure

A video is probed (its container's header: frame count, rate, size; no frame is decoded) and planned
as it is read from the stream, in the calling thread, so that its pieces can be submitted to the
workers like images; each piece then decodes (seeking) only its own frames in a worker. A video the
model cannot take (no video processor, no video stream, a size the processor refuses, ...) is one
LoadFailure naming the input."""
import os
import uuid
from collections.abc import Iterable, Iterator
from typing import Any

from mmenc.preprocess.images import ImageLoadError, LoadFailure
from mmenc.preprocess.plan import input_name
from mmenc.preprocess.video import Video, VideoPiece
from mmenc.preprocess.video_decode import looks_like_video, probe

DEFAULT_PIECE_PATCHES = 16384  # rows of one piece when the call sets no chunk size (a long video still streams)


def as_video(item: Any) -> Video | None:
    """A Video for a Video, a path with a video extension or bytes of a video container; else None."""
    if isinstance(item, Video):
        return item
    return Video(item) if looks_like_video(item) else None


def video_name(video: Video, index: int) -> str:
    """How messages name a video: its path in quotes, else "video #i"."""
    if isinstance(video.source, (str, os.PathLike)):
        return input_name(video.source, index)
    return f"video #{index}"


class VideoUnits:
    """Expands the videos of one call into pieces of at most `piece_patches` rows (whole temporal units),
    the first of each video at most `first_patches` (None: piece_patches), doubling from there, in at most
    `lanes` decode lanes per video (VideoProcessor.pieces: one per worker lets a long video's key-frame
    intervals decode in parallel). video_processor: the model's (None: a video input is a failure saying
    the model takes none)."""

    def __init__(self, video_processor: Any, piece_patches: int | None, first_patches: int | None = None,
                 lanes: int = 1):
        self.video, self.piece_patches = video_processor, piece_patches or DEFAULT_PIECE_PATCHES
        self.first_patches = first_patches  # a video's first piece (then doubling): VideoProcessor.pieces
        self.lanes = max(1, lanes)
        self._failed: set[int] = set()
        self._videos: set[int] = set()

    def expand(self, items: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        for index, item in enumerate(items):
            video = as_video(item)
            if video is None:
                yield index, item
                continue
            self._videos.add(index)
            try:
                pieces = self._pieces(index, video)
            except (ImageLoadError, ValueError) as e:
                name = video_name(video, index)
                message = str(e) if str(e).startswith(name) else f"{name}: {e}"
                yield index, LoadFailure(index, name, message)
                continue
            for piece in pieces:
                yield index, piece

    def _pieces(self, index: int, video: Video) -> list[VideoPiece]:
        name = video_name(video, index)
        if self.video is None:
            raise ValueError(f"{name}: this model takes no video (its family has no video processor in mmenc; "
                             f"see mmenc.preprocess.video_families)")
        metadata = probe(video.source, name)
        plan = self.video.plan(metadata, video.options, name)
        return self.video.pieces(video.source, name, plan, self.piece_patches, self.first_patches,
                                 video_id=uuid.uuid4().hex, lanes=self.lanes)

    def skip(self, result: Any) -> bool:
        """Whether a prepared result (Ready or LoadFailure) belongs to a video that has failed already
        (its first failure was reported; its other pieces are dropped). Records failures of videos."""
        index = getattr(result, "index", None)
        if index not in self._videos:
            return False
        if index in self._failed:
            return True
        if isinstance(result, LoadFailure):
            self._failed.add(index)
        return False
