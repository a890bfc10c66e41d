"""Videos in the offline Ray Data job (mmenc.ray.data): a video key becomes one row per piece (runs of
whole temporal units, mmenc.preprocess.video), so a CPU task decodes (seeking) and patchifies one
piece, the encoder actors encode pieces like images, and memory per task stays bounded however long
the video; the driver joins the pieces of a key back in order before writing its shard.

Rows gain `piece` / `pieces` (0 / 1 for an image) and `video` (the VideoInfo as JSON, "" for an
image). Each piece holds one grid row (a Kimi piece is one 4-frame chunk), as the images' rows do."""
import json
import os

import numpy as np
import torch

from mmenc.preprocess.images import ImageLoadError
from mmenc.preprocess.video_decode import VIDEO_EXTENSIONS, probe
from mmenc.preprocess.video_sampling import VideoOptions


def is_video_key(key: str) -> bool:
    return os.path.splitext(key.split("?", 1)[0])[1].lower() in VIDEO_EXTENSIONS


def _source(key: str):
    """A local path as it is (PyAV seeks in the file), a URI's bytes."""
    if "://" not in key:
        return key
    from mmenc.ray.stages import read_bytes

    return read_bytes(key)


def _pieces(key: str, video_processor, options: VideoOptions, piece_patches: int, source=None):
    if video_processor is None:
        raise ValueError("this model takes no video")
    source = _source(key) if source is None else source
    name = repr(key)
    plan = video_processor.plan(probe(source, name), options, name)
    rows = plan.unit_rows if video_processor.chunked else piece_patches
    return video_processor.pieces(source, name, plan, rows)


def expand_row(row: dict, *, video_processor, options: dict, piece_patches: int) -> list[dict]:
    """flat_map stage: an image row as it is; a video row -> one row per piece (or one row with its error)."""
    key = str(row["key"])
    base = {**row, "piece": 0, "pieces": 1, "video": "", "error": ""}
    if not is_video_key(key):
        return [base]
    try:
        pieces = _pieces(key, video_processor, VideoOptions(**options), piece_patches)
    except (ImageLoadError, OSError, ValueError) as e:
        return [{**base, "error": f"{key!r}: {str(e).removeprefix(repr(key) + ': ')}"}]
    info = json.dumps(pieces[0].info.as_dict())
    return [{**base, "piece": p.piece, "pieces": p.pieces, "video": info} for p in pieces]


def prepare_piece(key: str, piece: int, *, video_processor, options: dict, piece_patches: int,
                  pixel_dtype: torch.dtype) -> tuple[bytes, np.ndarray]:
    """CPU stage, one video piece: (pixels [patches, C*tp*p*p] as bytes in pixel_dtype, grid int64 [3])."""
    from mmenc.ray.stages import to_bytes

    p = _pieces(key, video_processor, VideoOptions(**options), piece_patches)[piece]
    patches = video_processor.patchify(video_processor.prepare_piece(p), p.plan)
    pixels = video_processor.as_pixel_values(video_processor.normalize(patches))
    return to_bytes(pixels.reshape(pixels.shape[0], -1).to(pixel_dtype)), np.asarray(p.plan.grid, np.int64)


def join_rows(rows: list[dict], decode) -> dict:
    """The rows of one video key (all its pieces, any order; `decode(row)` -> its embedding tensor) ->
    the shard tensors of `mmenc encode`'s layout (key, .grid_thw, .frames_indices, .timestamps) and
    the metadata entry {"video:KEY": info JSON}."""
    rows = sorted(rows, key=lambda r: int(r["piece"]))
    key, info = str(rows[0]["key"]), json.loads(str(rows[0]["video"]))
    embeddings = torch.cat([decode(r) for r in rows])
    tensors = {key: embeddings, f"{key}.grid_thw": torch.tensor(info["grid_thw"], dtype=torch.int64),
               f"{key}.frames_indices": torch.tensor(info["frames_indices"], dtype=torch.int64)}
    if info.get("timestamps") is not None:
        tensors[f"{key}.timestamps"] = torch.tensor(info["timestamps"], dtype=torch.float64)
    return {"tensors": tensors, "metadata": {f"video:{key}": json.dumps(info)}}
