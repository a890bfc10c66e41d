"""A batch's TowerOutput cut per image, and several calls' outputs joined (the Encoder's results)."""
import dataclasses
from typing import Any

import torch

from mmenc.models.base import TowerOutput


@dataclasses.dataclass
class ImageEmbedding:
    """One image's embeddings [tokens, out_hidden] and its share of the tower's extra outputs."""

    embeddings: torch.Tensor
    extras: dict[str, Any]


def split_per_image(out: TowerOutput, tokens: list[int]) -> list[ImageEmbedding]:
    """Cut a batch's TowerOutput into one ImageEmbedding per image (tensor extras are cut alike)."""
    embeddings = out.embeddings.split(tokens)
    pieces = [ImageEmbedding(e, {}) for e in embeddings]
    for key, value in out.extras.items():
        if isinstance(value, torch.Tensor):
            for p, v in zip(pieces, value.split(tokens)):
                p.extras[key] = v
        elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            per_level = [v.split(tokens) for v in value]
            for i, p in enumerate(pieces):
                p.extras[key] = [level[i] for level in per_level]
        else:
            for p in pieces:
                p.extras[key] = value
    return pieces


def concat_outputs(outputs: list[TowerOutput]) -> TowerOutput:
    extras = {}
    for key, value in outputs[0].extras.items():
        if isinstance(value, torch.Tensor):
            extras[key] = torch.cat([o.extras[key] for o in outputs])
        elif isinstance(value, (list, tuple)):
            extras[key] = [torch.cat([o.extras[key][i] for o in outputs]) for i in range(len(value))]
        else:
            extras[key] = value
    return TowerOutput(torch.cat([o.embeddings for o in outputs]), extras)


def whole_image_runs(pixel_values: torch.Tensor, grid_thw: torch.Tensor, max_patches: int):
    """(pixel_values, grid_thw) runs of whole images of at most `max_patches` patches each (one image
    may exceed it alone)."""
    sizes = grid_thw[:, :3].prod(-1).tolist()  # t*h*w (LLaVA-NeXT rows add columns after them)
    start_img, start_patch, count = 0, 0, 0
    for i, n in enumerate(sizes):
        if count and count + n > max_patches:
            yield pixel_values[start_patch:start_patch + count], grid_thw[start_img:i]
            start_img, start_patch, count = i, start_patch + count, 0
        count += n
    yield pixel_values[start_patch:start_patch + count], grid_thw[start_img:]
