"""Which frames of a video each family keeps, and the timing the language model gets with them:
transformers' video processors' `sample_frames` and their processors' timestamps, rule for rule.

    options = VideoOptions(fps=2)                                  # None fields: the processor's defaults
    indices = sample_indices("qwen3", metadata, options, defaults)  # int64 [n]

Samplers (`SamplingDefaults.sampler`):
  "qwen2": Qwen2VLVideoProcessor (Qwen2-VL, Qwen2.5-VL, Qwen3-Omni): num_frames rounded to
           temporal_patch_size; fps -> total/fps*F clamped to [min_frames, max_frames, total] and
           floored to temporal_patch_size; indices arange(0, total, total/n) in float32, truncated.
  "qwen3": Qwen3VLVideoProcessor: fps -> int(total/fps*F) clamped to [min_frames, max_frames, total]
           (24 fps assumed without metadata); indices linspace(0, total-1, n), rounded.
  "glm4v": Glm4vVideoProcessor: ceil(i*fps/F) for i < floor(duration*F) (duration up to max_duration,
           else linspace over it), duplicates removed, an odd count padded with the last index.
  "uniform": transformers' default_sample_indices_fn (Kimi-K2.5): n = max(1, int(total/fps*F)) or
           num_frames; indices arange(n) * total // n.
With do_sample_frames off every frame is kept (arange(total)).
"""
import dataclasses
import math

import numpy as np
import torch

from mmenc.preprocess.video_decode import VideoMetadata

SAMPLERS = ("qwen2", "qwen3", "glm4v", "uniform")


@dataclasses.dataclass(frozen=True)
class VideoOptions:
    """Per-video sampling settings; None keeps the processor's (its video_preprocessor_config.json or
    transformers' class default). fps and num_frames exclude each other; giving either turns frame
    sampling on (transformers ignores both while do_sample_frames is off)."""

    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None
    do_sample_frames: bool | None = None

    def __post_init__(self):
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, (int, float))
                                     or not self.fps > 0):
            raise ValueError(f"fps={self.fps!r} must be a number > 0 (frames sampled per second, e.g. 2)")
        for name in ("num_frames", "min_frames", "max_frames"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be an int >= 1")
        if self.fps is not None and self.num_frames is not None:
            raise ValueError(f"fps={self.fps} and num_frames={self.num_frames} exclude each other; give one")

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclasses.dataclass(frozen=True)
class SamplingDefaults:
    """A video processor's own sampling settings (class defaults overridden by its config file)."""

    sampler: str
    do_sample_frames: bool
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    temporal_patch_size: int = 2
    max_duration: int = 300  # glm4v

    def __post_init__(self):
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler={self.sampler!r}; expected one of {SAMPLERS}")

    def takes(self) -> tuple[str, ...]:
        """The VideoOptions fields this sampler reads."""
        return {"qwen2": ("fps", "num_frames", "min_frames", "max_frames"), "qwen3": ("fps", "num_frames", "min_frames",
                "max_frames"), "glm4v": ("fps",), "uniform": ("fps", "num_frames")}[self.sampler]


def sample_indices(metadata: VideoMetadata, options: VideoOptions, defaults: SamplingDefaults) -> np.ndarray:
    """int64 [n] frame indices, ascending, as the family's transformers processor picks them."""
    given = [k for k, v in options.as_dict().items() if k != "do_sample_frames" and v is not None]
    if refused := [k for k in given if k not in defaults.takes()]:
        raise ValueError(f"{refused[0]}={getattr(options, refused[0])} is not a setting of this family's video "
                         f"sampling ({defaults.sampler}); it takes {', '.join(defaults.takes())}")
    sample = options.do_sample_frames
    if sample is None:
        sample = defaults.do_sample_frames or options.fps is not None or options.num_frames is not None
    total = metadata.total_num_frames
    if not sample:
        return np.arange(total, dtype=np.int64)
    d = dataclasses.replace(defaults, **{k: getattr(options, k) for k in ("min_frames", "max_frames")
                                         if getattr(options, k) is not None})
    num = options.num_frames if options.num_frames is not None else (None if options.fps is not None else d.num_frames)
    fps = options.fps if options.fps is not None else (None if options.num_frames is not None else d.fps)
    return np.asarray(_SAMPLERS[d.sampler](metadata, d, num, fps), dtype=np.int64)


def _needs_fps(metadata: VideoMetadata, what: str) -> float:
    if metadata.fps is None:
        raise ValueError(f"{what} sampling by fps needs the video's frame rate, which its container does not give; "
                         f"pass num_frames instead")
    return metadata.fps


def _qwen2(metadata: VideoMetadata, d: SamplingDefaults, num: int | None, fps: float | None):
    total, tp = metadata.total_num_frames, d.temporal_patch_size
    if num is not None:
        num = round(num / tp) * tp
    elif fps is not None:
        video_fps = _needs_fps(metadata, "Qwen2-VL")
        max_frames = math.floor(min(d.max_frames, total) / tp) * tp
        num = min(max(total / video_fps * fps, d.min_frames), max_frames, total)
        num = math.floor(num / tp) * tp
    if num is None:
        return torch.arange(0, total).int().numpy()
    if num > total or num <= 0:
        raise ValueError(f"cannot sample {num} frames of a {total}-frame video (temporal_patch_size={tp}); "
                         f"lower fps / num_frames, or raise min_frames")
    return torch.arange(0, total, total / num).int().numpy()


def _qwen3(metadata: VideoMetadata, d: SamplingDefaults, num: int | None, fps: float | None):
    total = metadata.total_num_frames
    if num is None and fps is not None:
        video_fps = metadata.fps if metadata.fps is not None else 24  # transformers' assumption
        num = min(max(int(total / video_fps * fps), d.min_frames), d.max_frames, total)
    if num is None:
        num = min(max(total, d.min_frames), d.max_frames)
    return np.linspace(0, total - 1, num).round().astype(int)


def _glm4v(metadata: VideoMetadata, d: SamplingDefaults, num: int | None, fps: float | None):
    video_fps = _needs_fps(metadata, "GLM-4.1V")
    total = metadata.total_num_frames
    requested = fps if fps is not None else 2.0  # the class default
    last = total - 1
    duration = metadata.duration or round(last / video_fps) + 1
    if duration <= d.max_duration:
        n = max(int(math.floor(duration * requested)), 1)
        picked = [min(last, int(math.ceil(i * video_fps / requested))) for i in range(n)]
    else:
        n = int(d.max_duration * requested)
        if n >= total:
            picked = list(range(total))
        else:
            picked = [min(last, int(math.ceil(t * video_fps))) for t in np.linspace(0, duration, n, endpoint=True)]
    unique = list(dict.fromkeys(picked))
    if len(unique) % 2:
        unique.append(unique[-1])
    return np.array(unique, dtype=int)


def _uniform(metadata: VideoMetadata, d: SamplingDefaults, num: int | None, fps: float | None):
    total = metadata.total_num_frames
    if num is None and fps is not None:
        num = max(1, int(total / _needs_fps(metadata, "Kimi-K2.5") * fps))
    if num is None:
        return np.arange(total, dtype=int)
    if num > total:
        raise ValueError(f"cannot sample num_frames={num} of a {total}-frame video; lower num_frames / fps")
    return np.arange(num, dtype=int) * total // num


_SAMPLERS = {"qwen2": _qwen2, "qwen3": _qwen3, "glm4v": _glm4v, "uniform": _uniform}


def frame_times(indices, metadata: VideoMetadata) -> list[float]:
    """Seconds of each sampled frame (index / fps; 24 fps assumed without one, as transformers does)."""
    fps = metadata.fps or 24.0
    return [int(i) / fps for i in indices]


def unit_timestamps(kind: str, indices, metadata: VideoMetadata, tp: int, units: int) -> list[float] | None:
    """The times the family's processor writes into the prompt, one per temporal unit of the grid:
    "qwen3": the mean of each temporal patch's first and last frame (Qwen3VLProcessor);
    "glm4v": every tp-th frame's time, padded with the last to `units` (Glm4vProcessor writes int() of it);
    "kimi": each chunk's first frame (Kimi_K25Processor); None for families that write none."""
    times = frame_times(indices, metadata)
    if kind == "qwen3":
        padded = times + [times[-1]] * (-len(times) % tp)
        return [(padded[i] + padded[i + tp - 1]) / 2 for i in range(0, len(padded), tp)]
    if kind == "glm4v":
        picked = times[::tp][:units]
        return picked + [picked[-1] if picked else 0.0] * (units - len(picked))
    if kind == "kimi":
        return [times[i] for i in range(0, len(times), tp)]
    return None
