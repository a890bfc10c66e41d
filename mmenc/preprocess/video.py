"""Video files -> (pixel_values, grid_thw, VideoInfo), exactly as the family's transformers video
processor, whole or in pieces that stream.

    vp = get_video_processor("qwen2_5_vl", video_config)        # mmenc.preprocess.video_families
    pixel_values, grid_thw, info = vp("clip.mp4", VideoOptions(fps=2))   # one call, whole video
    plan = vp.plan(probe("clip.mp4"), VideoOptions(fps=2))      # frames, size, grid: no decoding
    for piece in vp.pieces("clip.mp4", "'clip.mp4'", plan, max_rows=16384): ...   # the pipeline's units

A video's frames are sampled from its metadata (mmenc.preprocess.video_sampling), resized together
to one size under the family's pixel budget (the Qwen "temporal" rule counts every frame), padded to a
whole temporal patch with the last frame, and cut into patches as transformers does. A `VideoPiece`
is a run of whole temporal units (Qwen: temporal_patch_size frames, one grid_t step; Kimi: a chunk of
temporal_patch_size frames, one grid row) of one video: decoded (seeking), resized and patchified on
its own, in a preprocessing worker. Every tower that takes video attends within a frame (Qwen, GLM)
or within a chunk (Kimi), so the pieces' embeddings, concatenated, are those of the whole video.
"""
import dataclasses
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from mmenc.preprocess import ops
from mmenc.preprocess.plan import ImagePlan, finish_patches
from mmenc.preprocess.video_decode import VideoMetadata, probe
from mmenc.preprocess.video_frames import DecodeCursors, decode
from mmenc.preprocess.images import size_text
from mmenc.preprocess.video_sampling import (SamplingDefaults, VideoOptions, frame_times, sample_indices,
                                             unit_timestamps)


@dataclasses.dataclass(frozen=True, init=False)
class Video:
    """A video input (a path or the encoded file's bytes) with its own sampling options:
    `encoder.encode([Video("clip.mp4", fps=2), "img.jpg"])` (keywords: VideoOptions' fields, or
    options=VideoOptions(...)). A bare path with a video extension or bytes of a video container are
    videos too, with the processor's default options."""

    source: Any
    options: VideoOptions

    def __init__(self, source: Any, options: VideoOptions | None = None, **sampling):
        if not isinstance(source, (str, os.PathLike, bytes, bytearray, memoryview)):
            raise ValueError(f"Video source {type(source).__name__} not supported; pass a path or the file's bytes")
        if options is not None and sampling:
            raise ValueError(f"Video(options=..., {', '.join(sampling)}=...): give options or its fields, not both")
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "options", options if options is not None else VideoOptions(**sampling))


@dataclasses.dataclass(frozen=True)
class VideoInfo:
    """What the language model needs beside a video's embeddings.

    grid_thw: the rows transformers' processor gives (one [t, h, w] for Qwen/GLM, one per 4-frame chunk
    for Kimi); frames_indices / frame_times: the sampled frames and their times (s); timestamps: per
    temporal unit, what the family's processor writes into the prompt (Qwen3-VL: mean of each frame
    pair; GLM-4.1V: each pair's first; Kimi: each chunk's first; None for Qwen2/2.5-VL, Qwen3-Omni);
    second_per_grid_ts: Qwen2.5-VL's (temporal_patch_size / sampled fps) and Qwen3-Omni's
    video_second_per_grid (temporal_patch_size / the fps asked for, 1.0 if none), else None."""

    grid_thw: tuple[tuple[int, int, int], ...]
    frames_indices: tuple[int, ...]
    frame_times: tuple[float, ...]
    timestamps: tuple[float, ...] | None
    second_per_grid_ts: float | None
    fps: float | None
    sampled_fps: float
    total_num_frames: int
    duration: float | None
    size: tuple[int, int]
    resized: tuple[int, int]

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return {k: (list(map(list, v)) if k == "grid_thw" else list(v) if isinstance(v, tuple) else v)
                for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class VideoPlan:
    """A whole video's preprocessing, from its metadata alone: the sampled frames, the size they are
    resized (and for Kimi padded) to, and the grid rows."""

    metadata: VideoMetadata
    options: VideoOptions
    indices: tuple[int, ...]
    resize: tuple[int, int]
    padded: tuple[int, int]
    grid: tuple[tuple[int, int, int], ...]
    unit_frames: int  # frames per temporal unit (one grid_t step, or one Kimi chunk)
    unit_rows: int  # rows of a full unit

    @property
    def units(self) -> int:
        return math.ceil(len(self.indices) / self.unit_frames)

    @property
    def rows(self) -> int:
        return sum(t * h * w for t, h, w in self.grid)


@dataclasses.dataclass(frozen=True)
class PiecePlan(ImagePlan):
    """A piece's ImagePlan (size, resize, padded; grid: its first row; rows) and all its grid rows."""

    grid_rows: tuple[tuple[int, int, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class VideoPiece:
    """Whole temporal units [first_unit, first_unit + len) of one video: what one worker prepares.
    frames: the piece's frame indices (the last piece is padded to a whole unit when patchified);
    piece / pieces: its position; info: the video's VideoInfo (on every piece, for the consumer);
    video_id: unique per video of a call ("": none); lane: the decode lane it belongs to (a run of
    consecutive pieces that one worker decodes one after the other, going on from the lane's previous
    piece through DecodeCursors, from a key frame; lanes of a video decode in parallel); lane_last: it
    ends its lane (the lane's decoder is closed after it)."""

    source: Any
    name: str
    metadata: VideoMetadata
    frames: tuple[int, ...]
    plan: PiecePlan
    piece: int
    pieces: int
    info: VideoInfo
    video_id: str = ""
    lane: int = 0
    lane_last: bool = True

    @property
    def last(self) -> bool:
        return self.piece == self.pieces - 1

    @property
    def decoder_key(self) -> tuple[str, int] | None:
        """The DecodeCursors key of its lane (None without a video_id: it seeks alone)."""
        return (self.video_id, self.lane) if self.video_id else None


KEY_MARGIN_FRAMES = 8  # a lane starts this far past a key frame's index estimate (decode-order timestamps run early)
LANE_MIN_SECONDS = 10.0  # without key frames in the index, lanes of at least this much video (each seeks once)


def video_lanes(plan: VideoPlan, lanes: int) -> list[int]:
    """Unit boundaries [0, ..., units] of at most `lanes` decode lanes of about equal length. A lane starts at
    the first unit after a key frame (metadata.keyframes), so a lane's seek decodes few frames before its
    first one and no lane decodes another's; without key frames, lanes of at least LANE_MIN_SECONDS
    (each may decode up to a key-frame interval again)."""
    units, meta = plan.units, plan.metadata
    starts = [plan.indices[u * plan.unit_frames] for u in range(units)]
    if meta.keyframes:
        candidates = sorted({u for k in meta.keyframes[1:] for u in [_first_at(starts, k + KEY_MARGIN_FRAMES)]
                             if 0 < u < units})
    else:
        seconds = meta.duration or units
        most = max(1, min(units, int(seconds // LANE_MIN_SECONDS)))
        candidates = [round(units * k / most) for k in range(1, most)]
    lanes = max(1, min(lanes, len(candidates) + 1))
    bounds = [0]
    for k in range(1, lanes):  # the candidate nearest each k/lanes of the video, keeping them ascending
        target = units * k / lanes
        ahead = [c for c in candidates if c > bounds[-1]]
        if not ahead:
            break
        bounds.append(min(ahead, key=lambda c: abs(c - target)))
    return bounds + [units]


def _first_at(starts: list[int], frame: int) -> int:
    """The first unit whose first frame is at or after `frame` (len(starts) if none)."""
    return next((u for u, f in enumerate(starts) if f >= frame), len(starts))


class VideoProcessor:
    """One family's video processing on top of its frame processor (QwenVLProcessor or KimiProcessor
    configured with the video's constants). kind: the family's metadata rules ("qwen2_vl",
    "qwen2_5_vl", "qwen3_vl", "qwen3_omni", "glm4v", "kimi_k25"). Offers the per-image API the
    pipeline drives (row_shape, patchify, normalize, as_pixel_values, finish) for VideoPiece pixels."""

    def __init__(self, frames: Any, sampling: SamplingDefaults, kind: str):
        self.frames, self.sampling, self.kind = frames, sampling, kind
        self.chunked = kind == "kimi_k25"  # Kimi: one grid row per chunk of temporal_patch_size frames
        self.config = frames.config

    # -- planning (metadata only) -------------------------------------------------------------------
    def plan(self, metadata: VideoMetadata, options: VideoOptions = VideoOptions(), name: str = "video") -> VideoPlan:
        """Sampling, size and grid of a video; ValueError (naming it) if the family cannot take it."""
        try:
            indices = tuple(int(i) for i in sample_indices(metadata, options, self.sampling))
            if not indices:
                raise ValueError("no frame was sampled")
            return self._plan(metadata, options, indices)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e

    def _plan(self, metadata: VideoMetadata, options: VideoOptions, indices: tuple[int, ...]) -> VideoPlan:
        c, n, (H, W) = self.config, len(indices), (metadata.height, metadata.width)
        tp, p = c.temporal_patch_size, c.patch_size
        if self.chunked:
            from mmenc.preprocess.kimi import navit_resize

            (h, w), (ph, pw) = navit_resize(H, W, p, c.merge_size, c.video_max_patches, c.max_size_per_side) \
                if c.do_resize else ((H, W), (H, W))
            grid = tuple((min(tp, n - s), ph // p, pw // p) for s in range(0, n, tp))
            return VideoPlan(metadata, options, indices, (h, w), (ph, pw), grid, tp, tp * (ph // p) * (pw // p))
        h, w = self.frames.target_size(H, W, n, video=True) if c.do_resize else (H, W)
        if h % c.factor or w % c.factor:
            raise ValueError(f"size {size_text(w, h)} is not a multiple of patch_size*merge_size={c.factor}")
        grid = ((math.ceil(n / tp), h // p, w // p),)
        return VideoPlan(metadata, options, indices, (h, w), (h, w), grid, tp, (h // p) * (w // p))

    def info(self, plan: VideoPlan) -> VideoInfo:
        meta, tp = plan.metadata, self.config.temporal_patch_size
        n = len(plan.indices)
        sampled_fps = n / meta.total_num_frames * meta.fps if meta.fps else 24.0
        second = {"qwen2_5_vl": tp / sampled_fps,
                  "qwen3_omni": tp / (plan.options.fps if plan.options.fps is not None else 1.0)}.get(self.kind)
        kind = {"qwen3_vl": "qwen3", "glm4v": "glm4v", "kimi_k25": "kimi"}.get(self.kind, "")
        stamps = unit_timestamps(kind, plan.indices, meta, tp, plan.units)
        return VideoInfo(grid_thw=plan.grid, frames_indices=plan.indices,
                         frame_times=tuple(frame_times(plan.indices, meta)),
                         timestamps=None if stamps is None else tuple(stamps), second_per_grid_ts=second, fps=meta.fps,
                         sampled_fps=sampled_fps, total_num_frames=meta.total_num_frames, duration=meta.duration,
                         size=(meta.height, meta.width), resized=plan.resize)

    def pieces(self, source: Any, name: str, plan: VideoPlan, max_rows: int,
               first_rows: int | None = None, video_id: str = "", lanes: int = 1) -> list[VideoPiece]:
        """The video cut into pieces of whole temporal units, each at most max_rows rows (at least one unit);
        with first_rows, the first piece takes at most that many and each next one twice the previous
        (so the tower's first call waits for a short decode only, as the chunk schedule's first call).
        lanes: at most this many decode lanes (video_lanes: runs of units starting at key frames, so
        that no lane decodes frames another one does); a piece never spans two lanes."""
        most = max(1, max_rows // plan.unit_rows)
        per = min(most, max(1, (first_rows or max_rows) // plan.unit_rows))
        spans = []  # (first unit, end unit, lane, ends its lane)
        bounds = video_lanes(plan, lanes)
        for lane, (l0, l1) in enumerate(zip(bounds, bounds[1:])):
            u0 = l0
            while u0 < l1:
                u1 = min(l1, u0 + per)
                spans.append((u0, u1, lane, u1 == l1))
                u0, per = u1, min(most, per * 2)
        info = self.info(plan)
        out = []
        for k, (u0, u1, lane, lane_last) in enumerate(spans):
            frames = plan.indices[u0 * plan.unit_frames:u1 * plan.unit_frames]
            out.append(VideoPiece(source, name, plan.metadata, frames, self._piece_plan(plan, frames, u1 - u0),
                                  k, len(spans), info, video_id, lane, lane_last))
        return out

    def _piece_plan(self, plan: VideoPlan, frames: Sequence[int], units: int) -> PiecePlan:
        _, gh, gw = plan.grid[0]
        tp = plan.unit_frames
        rows = tuple((min(tp, len(frames) - s), gh, gw) for s in range(0, len(frames), tp)) if self.chunked \
            else ((units, gh, gw),)
        meta = plan.metadata
        return PiecePlan(size=(meta.height, meta.width), resize=plan.resize, padded=plan.padded, grid=rows[0],
                         rows=sum(t * h * w for t, h, w in rows), grid_rows=rows)

    # -- one piece: decode + resize (a worker), patchify + normalize (the pipeline) ---------------------
    def prepare_piece(self, piece: VideoPiece, cursors: DecodeCursors | None = None) -> torch.Tensor:
        """Decode (seeking, or going on from the video's previous piece through `cursors`) and resize ->
        uint8 [frames, C, *padded] (what crosses to the device)."""
        frames = decode(piece.source, piece.frames, piece.metadata, piece.name, cursors=cursors,
                        key=piece.decoder_key, keep=not piece.lane_last)  # [n, H, W, 3]
        return self.resize(torch.from_numpy(frames).permute(0, 3, 1, 2), piece.plan)

    def resize(self, frames: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """uint8 [n, C, H, W] -> uint8 [n, C, *plan.padded] with the family's resize (and Kimi's zero padding)."""
        c = self.config
        if not c.do_resize:
            return frames.contiguous()
        (h, w), (ph, pw) = plan.resize, plan.padded
        x = ops.resize_uint8(frames, h, w, c.backend)  # a [n, H, W, C] view as decoded: torch's kernel takes it as is
        if (ph, pw) != (h, w):
            x = torch.nn.functional.pad(x, (0, pw - w, 0, ph - h))
        return x

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.frames.row_shape

    def patchify(self, frames: torch.Tensor, plan: ImagePlan) -> torch.Tensor:
        """Resized uint8 [n, C, h, w] -> uint8 [rows, *row_shape]: Qwen patches (t, h/m, w/m, m, m) each
        (C, tp, p, p), the frames padded to a whole temporal patch with the last; Kimi frame by frame,
        each in raster order (C, p, p)."""
        c = self.config
        p, n, ch, h, w = c.patch_size, *frames.shape
        gh, gw = h // p, w // p
        if self.chunked:
            x = frames.contiguous().view(n, ch, gh, p, gw, p).permute(0, 2, 4, 1, 3, 5)  # n, gh, gw, C, p, p
            return x.reshape(n * gh * gw, ch, p, p)
        m, tp = c.merge_size, c.temporal_patch_size
        if pad := -n % tp:  # repeat the last frame
            frames = torch.cat([frames, frames[-1:].expand(pad, ch, h, w)])
        gt = frames.shape[0] // tp
        x = frames.contiguous().view(gt, tp, ch, gh // m, m, p, gw // m, m, p)
        x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m, C, tp, p, p
        return x.reshape(gt * gh * gw, ch, tp * p * p)

    def normalize(self, patches: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.frames.normalize(patches, out=out)

    def as_pixel_values(self, x: torch.Tensor) -> torch.Tensor:
        return self.frames.as_pixel_values(x)

    def finish(self, frames: Sequence[torch.Tensor], plans: Sequence[ImagePlan]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pieces' resized frames -> (pixel_values float32 on their device, grid_thw int64 on the CPU)."""
        return finish_patches(self, [self.patchify(f, pl) for f, pl in zip(frames, plans)], plans)

    # -- one whole video, sequentially (the reference path) ---------------------------------------------
    def __call__(self, video: Any, options: VideoOptions = VideoOptions(), *, metadata: VideoMetadata | None = None,
                 name: str = "video") -> tuple[torch.Tensor, torch.Tensor, VideoInfo]:
        """A video file (path or bytes), or its decoded frames (uint8 [T, H, W, 3] with `metadata`, or
        without: every frame at 24 fps as transformers assumes) -> (pixel_values float32 [P, D] (Kimi
        [P, C, p, p]), grid_thw int64 [rows, 3], VideoInfo). Frames are sampled from the array as from a file."""
        if isinstance(video, (np.ndarray, torch.Tensor)):
            array = np.asarray(video)
            if array.ndim != 4 or array.shape[-1] != 3 or array.dtype != np.uint8:
                raise ValueError(f"frames of shape {array.shape} dtype {array.dtype}; expected uint8 [T, H, W, 3]")
            metadata = metadata or VideoMetadata(array.shape[0], None, None, array.shape[1], array.shape[2])
            plan = self.plan(metadata, options, name)
            frames = array[list(plan.indices)]
        else:
            metadata = metadata or probe(video, name)
            plan = self.plan(metadata, options, name)
            frames = decode(video, plan.indices, metadata, name)
        whole = self._piece_plan(plan, plan.indices, plan.units)
        resized = self.resize(torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2), whole)
        pixel_values, grid_thw = self.finish([resized], [whole])
        return pixel_values, grid_thw, self.info(plan)
