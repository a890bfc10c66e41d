"""Videos in `Encoder.encode` / `encode_iter`: a video's pieces (mmenc.preprocess.video.VideoPiece,
runs of whole temporal units that the pipeline prepares and the tower encodes like images) put back
together into one VideoEmbedding, with the metadata the language model needs.

Every video tower attends within a frame (Qwen, GLM) or a 4-frame chunk (Kimi), so the pieces'
embeddings, concatenated in order, are the whole video's as one tower call would give them (up to the
GEMMs' rounding for other batch sizes; bitwise with batch_invariant=True)."""
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mmenc.preprocess.video import VideoInfo


@dataclasses.dataclass
class VideoEmbedding:
    """One video's embeddings [tokens, out_hidden] (all its temporal units, in order), its share of the
    tower's extra outputs (e.g. Qwen3-VL's deepstack list) and `video`: its VideoInfo (grid_thw,
    sampled frames, timestamps, second_per_grid_ts, ...)."""

    embeddings: torch.Tensor
    extras: dict[str, Any]
    video: VideoInfo

    @property
    def grid_thw(self) -> torch.Tensor:
        """int64 [rows, 3]: what transformers' processor gives as video_grid_thw for this video."""
        return torch.tensor(self.video.grid_thw, dtype=torch.int64)


def entry_tokens(videos: tuple, grid_rows: int, tokens: list[int]) -> list[int]:
    """Output rows per chunk entry (image, or video piece with one or more grid rows) from the rows
    per grid row (`tokens`); videos: Chunk.videos (() when the chunk holds no video)."""
    if not videos:
        return tokens
    out, row = [], 0
    for piece in videos:
        n = len(piece.plan.grid_rows) if piece is not None else 1
        out.append(sum(tokens[row:row + n]))
        row += n
    assert row == grid_rows, (row, grid_rows)
    return out


class VideoAssembler:
    """Collects each video's pieces (in order) until its last, then hands out the VideoEmbedding.
    State of one encode/encode_iter call.

    tokens_of(grid rows) -> the embedding rows they yield (the Encoder's output_tokens, summed): a video of
    several pieces gets its output allocated at its first piece (the rows of its whole grid) and each
    piece is copied in as it comes, so that the chunk output a piece is a view of can go once it is
    handed out; device memory beyond the video's own embeddings is then a chunk's, whatever the length.
    Extras (e.g. Qwen3-VL's deepstack) are held per piece and joined at the end."""

    def __init__(self, tokens_of: Callable[[Sequence[Sequence[int]]], int]):
        self._parts: dict[int, _Filling] = {}
        self._failed: set[int] = set()
        self._tokens_of = tokens_of

    def fail(self, index: int) -> None:
        """The video at `index` failed: its pieces so far are dropped, later ones ignored."""
        self._parts.pop(index, None)
        self._failed.add(index)

    def take(self, index: int, piece: Any, part: Any) -> VideoEmbedding | None:
        """part: the piece's ImageEmbedding (embeddings, extras); the video's VideoEmbedding after its last piece."""
        if index in self._failed:
            return None
        held = self._parts.get(index)
        if held is None:
            if piece.last:  # the whole video in one piece: nothing to join
                return VideoEmbedding(part.embeddings, part.extras, piece.info)
            held = self._parts[index] = _Filling(self._tokens_of(piece.info.grid_thw), part.embeddings)
        held.add(part)
        if not piece.last:
            return None
        del self._parts[index]
        return VideoEmbedding(held.embeddings(), _cat_extras(held.extras), piece.info)


class _Filling:
    """A video's embeddings written piece by piece into its output (rows: the whole video's)."""

    def __init__(self, rows: int, like: torch.Tensor):
        self.out = like.new_empty((rows, *like.shape[1:]))
        self.filled = 0
        self.extras: list[dict[str, Any]] = []

    def add(self, part: Any) -> None:
        n = part.embeddings.shape[0]
        if self.filled + n > self.out.shape[0]:
            raise RuntimeError(f"a video's pieces yield more than the {self.out.shape[0]} embedding rows of its "
                               f"grid ({self.filled} + {n}); a bug in the pieces' planning, please report it")
        self.out[self.filled:self.filled + n].copy_(part.embeddings)
        self.filled += n
        self.extras.append(part.extras)

    def embeddings(self) -> torch.Tensor:
        if self.filled != self.out.shape[0]:
            raise RuntimeError(f"a video's pieces yield {self.filled} embedding rows, its grid "
                               f"{self.out.shape[0]}; a bug in the pieces' planning, please report it")
        return self.out


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _cat_extras(extras: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in extras[0].items():
        if isinstance(value, torch.Tensor):
            out[key] = _cat([e[key] for e in extras])
        elif isinstance(value, (list, tuple)) and all(isinstance(v, torch.Tensor) for v in value):
            out[key] = [_cat([e[key][i] for e in extras]) for i in range(len(value))]
        else:
            out[key] = value
    return out
