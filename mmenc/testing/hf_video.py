"""transformers' video processors as the video tests and `mmenc bench --video` call them (needs
torchvision; imported only where it is installed): the class for each mmenc video kind, and one
call on decoded frames with mmenc's sampling options."""
import numpy as np

from mmenc.preprocess.video_sampling import VideoOptions


def hf_processor(kind: str, config: dict):
    from transformers import Glm4vVideoProcessor, Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    from transformers.models.kimi_k25.video_processing_kimi_k25 import Kimi_K25VideoProcessor

    if kind == "qwen3_omni":  # the Omni processor: Qwen2VLVideoProcessor, patch 16, called with its own size
        base = dict(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3)
        return Qwen2VLVideoProcessor(**{**base, **config}), {"size": {"shortest_edge": 128 * 32 * 32,
                                                                      "longest_edge": 768 * 32 * 32}}
    cls = {"qwen2_vl": Qwen2VLVideoProcessor, "qwen2_5_vl": Qwen2VLVideoProcessor, "qwen3_vl": Qwen3VLVideoProcessor,
           "glm4v": Glm4vVideoProcessor, "kimi_k25": Kimi_K25VideoProcessor}[kind]
    return cls(**config), {}


def quiet_kwargs(proc) -> dict:
    """cap_pixels_per_frame=False where the processor has it (transformers >= 5.2x: its default, said
    explicitly so it does not warn; older versions have no such setting)."""
    return {"cap_pixels_per_frame": False} if "cap_pixels_per_frame" in getattr(proc.valid_kwargs, "__annotations__",
                                                                                  {}) else {}


def hf_call(kind: str, config: dict, frames: np.ndarray, meta, options: VideoOptions):
    """transformers on our decoded frames and metadata, sampling on (as mmenc turns it on when fps or
    num_frames is given) -> (pixel_values, grid_thw, frames_indices)."""
    from transformers.video_utils import VideoMetadata

    proc, extra = hf_processor(kind, config)
    kwargs = dict(extra, return_metadata=True, return_tensors="pt")
    kwargs.update(quiet_kwargs(proc))
    sample = options.do_sample_frames
    if sample is None:
        sample = proc.do_sample_frames or options.fps is not None or options.num_frames is not None
    kwargs["do_sample_frames"] = sample
    if options.num_frames is not None:
        kwargs.update(num_frames=options.num_frames, fps=None)
    elif options.fps is not None:
        kwargs["fps"] = options.fps
    for k in ("min_frames", "max_frames"):  # Qwen3-VL reads these from the processor, not the call
        if getattr(options, k) is not None:
            setattr(proc, k, getattr(options, k))
            kwargs[k] = getattr(options, k)
    hf_meta = VideoMetadata(total_num_frames=meta.total_num_frames, fps=meta.fps, duration=meta.duration,
                            height=meta.height, width=meta.width, video_backend="pyav")
    out = proc(videos=[frames], video_metadata=[hf_meta], **kwargs)
    indices = out["video_metadata"][0].frames_indices
    indices = np.arange(meta.total_num_frames) if indices is None else np.asarray(indices)
    return out["pixel_values_videos"], out["video_grid_thw"], indices, out["video_metadata"][0]
