"""Videos in `mmenc serve`: one item of a request (a data URL `data:video/mp4;base64,...`, `{"data": ...}`
or a multipart file part whose bytes are a video container) becomes the tower jobs of its pieces, and
the pieces' answers one EncodedImage with the video's metadata.

A video is probed, planned and decoded piece by piece (seeking) in a pool thread, each piece's
frames resized and patchified there (uint8, normalized by the batcher on the device like images when
the server batches uint8; else float pixel_values in the tower's dtype, as images), and submitted as its
own job of at most max_batch_patches rows and one grid row, so a long video never makes one huge
tower call and the batcher mixes its pieces with other requests' images. The pieces' keys are the
video's key plus "/k", so a repeated video is answered from the encoder cache.

Sampling options come from the request (`fps`, `num_frames`, `min_frames`, `max_frames` fields, for
all its videos); none: the model's video processor defaults. vLLM's `vllm` format of a video:
`{"type": "video_embeds", "video_embeds": {"video_embeds": B64, "video_grid_thw": B64 [rows, 3]
(, "second_per_grid_ts": B64 [1] for Qwen2.5-VL)}}` (docs/serving.md, Video)."""
import dataclasses

import torch

from mmenc.preprocess.images import ImageLoadError
from mmenc.preprocess.video_decode import looks_like_video, probe  # noqa: F401  (service.py's test)
from mmenc.preprocess.video_sampling import VideoOptions
from mmenc.serving.inputs import ItemError, video_options  # noqa: F401  (service.py's import)




@dataclasses.dataclass
class VideoJobs:
    """A video's pieces as (job key suffix, pixel_values, grid [1, 3]) and its VideoInfo as a dict."""

    parts: list[tuple[str, torch.Tensor, torch.Tensor]]
    info: dict
    second_per_grid_ts: float | None


def same_normalization(video_processor, processor) -> bool:
    """Whether the batcher's image normalization (on the device) gives the video processor's values."""
    a, b = video_processor.config, getattr(processor, "config", None)
    keys = ("image_mean", "image_std", "rescale_factor", "do_rescale", "do_normalize", "backend")
    return b is not None and all(getattr(a, k, None) == getattr(b, k, None) for k in keys) and \
        video_processor.row_shape == getattr(processor, "row_shape", None)


def prepare_video(video_processor, processor, data: bytes, index: int, options: VideoOptions, max_rows: int,
                  uint8: bool, dtype: torch.dtype) -> VideoJobs | ItemError:
    """Decode, resize and patchify one video's pieces (a pool thread) -> VideoJobs, or the item's error."""
    name = f"images[{index}] (video)"
    if video_processor is None:
        return ItemError("unsupported_input", f"{name}: this model takes no video")
    try:
        plan = video_processor.plan(probe(data, name), options, name)
        # one grid row per job (the batcher's contract): Kimi pieces of one 4-frame chunk
        rows = plan.unit_rows if video_processor.chunked else max_rows
        pieces = video_processor.pieces(data, name, plan, rows)
        if uint8 and not same_normalization(video_processor, processor):  # a batch is normalized as one
            return ItemError("unsupported_video", f"{name}: this model's video processor normalizes differently "
                                                  f"from its image processor, which this server's batches use")
        parts = []
        for piece in pieces:
            patches = video_processor.patchify(video_processor.prepare_piece(piece), piece.plan).contiguous()
            if not uint8:  # float pixel_values in the tower's dtype, as images are sent
                patches = video_processor.as_pixel_values(video_processor.normalize(patches)).to(dtype)
            parts.append((f"/{piece.piece}", patches, torch.tensor([list(piece.plan.grid)], dtype=torch.int64)))
    except ImageLoadError as e:  # VideoDecodeError: names the frame and time
        return ItemError("invalid_video", str(e))
    except ValueError as e:  # sampling / size rules of the family
        return ItemError("unsupported_video", str(e))
    info = pieces[0].info
    return VideoJobs(parts, info.as_dict(), info.second_per_grid_ts)


def join(images: list, video: VideoJobs):
    """The pieces' EncodedImages (in order) -> one EncodedImage of the whole video."""
    from mmenc.serving.formats import EncodedImage

    full = images[0].full if len(images) == 1 else torch.cat([im.full for im in images])
    grid = tuple(video.info["grid_thw"][0])
    return EncodedImage(full, images[0].hidden, grid, video=video.info)
