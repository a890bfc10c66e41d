"""The Encoder's pipelined path (`encode`, `encode_iter`): the Preprocessor's chunks, each launched as
one tower call while the next is prepared, results handed out per image in input order, a video's
pieces joined into its VideoEmbedding. The host reads no device value between chunks except through
a ChunkWindow (mmenc.engine.inflight). docs/engine.md, Pipelining."""
import time
from collections.abc import Iterable, Iterator
from typing import Any

from mmenc.engine.checks import finite_flag
from mmenc.engine.inflight import ChunkWindow, Launched
from mmenc.engine.outputs import ImageEmbedding, split_per_image
from mmenc.engine.videos import VideoAssembler, entry_tokens
from mmenc.models.base import TowerOutput
from mmenc.preprocess.images import LoadFailure
from mmenc.preprocess.pipeline import Chunk


def stream(enc, images: Iterable[Any], *, stop_on_failure: bool, pooled: bool = False
           ) -> Iterator[tuple[int, ImageEmbedding | LoadFailure]]:
    """`enc`'s (an Encoder's) (index, ImageEmbedding | LoadFailure) in input order. Chunks follow
    `enc.chunk_schedule`; chunk
    k's results are handed out after chunk k+1's tower call is queued, and the host reads no
    device value on the way except through a ChunkWindow (mmenc.engine.inflight): on CUDA the
    device never waits for the host between chunks while the workers keep up. stop_on_failure:
    no tower call after the first failure (encode with errors="raise" only collects the failures
    then). pooled: each ImageEmbedding also carries extras["pooled"] [hidden] (see `pool`).
    Seconds spent land in enc.tally (chunk_wait_s, launch_s, device_wait_s, consumer_s)."""
    chunks = enc.preprocessor.iter_chunks(images, schedule=enc.chunk_schedule, errors="skip")
    window = ChunkWindow(depth=enc.chunks_in_flight, strict=enc.strict, tally=enc.tally)
    videos = VideoAssembler(lambda rows: sum(enc.output_tokens(rows)))  # a long video's pieces, until its last
    failed = False
    try:
        while True:
            with enc.tally.time("chunk_wait_s"):  # blocked on the workers, or staging the chunk
                chunk = next(chunks, None)
            if chunk is None:
                break
            failed = failed or bool(chunk.failures)
            launched = Launched(chunk)
            if chunk.indices and not (failed and stop_on_failure):
                with enc.tally.time("launch_s"):
                    launched = _launch(enc, chunk, pooled)
            for done in window.push(launched):
                yield from _hand_out(enc, done, videos)
        for done in window.drain():
            yield from _hand_out(enc, done, videos)
    finally:
        chunks.close()


def _launch(enc, chunk: Chunk, pooled: bool) -> Launched:
    """Queue one chunk's tower call (and its finite flag); nothing here waits for the device."""
    pixel_values = chunk.pixel_values
    if pixel_values.dim() > 2:  # [P, C, p, p] (Kimi's processor) -> one row per patch
        pixel_values = pixel_values.reshape(pixel_values.shape[0], -1)
    with enc._lock:  # per tower call: other threads' calls interleave between chunks
        out = enc._run(pixel_values, chunk.grid_thw)
        if pooled:  # [N, hidden], one row per image: not token-aligned, handed out by _deliver
            out = TowerOutput(out.embeddings, {**out.extras, "pooled": enc.pool(out.embeddings, chunk.grid_thw)})
        flag = finite_flag(out.embeddings)  # CUDA calls (a pinned buffer, an event): never beside a capture
    enc.tally.add(tower_calls=1, images=len(chunk.indices))
    return Launched(chunk, out, flag, enc.output_tokens(chunk.grid_thw))


def _hand_out(enc, launched: Launched, videos: VideoAssembler):
    """_deliver's items, the caller's time between them counted as consumer_s."""
    for item in _deliver(enc, launched, videos):
        begin = time.perf_counter()
        yield item
        enc.tally.add(consumer_s=time.perf_counter() - begin)


def _deliver(enc, launched: Launched, videos: VideoAssembler):
    """One chunk's failures and (if it ran) per-image results, merged in input order (the finite
    check is the ChunkWindow's); a video's pieces go to `videos`, which gives its VideoEmbedding
    after its last piece."""
    chunk, out = launched.chunk, launched.out
    items: list[tuple[int, Any]] = [(f.index, f) for f in chunk.failures]
    for f in chunk.failures:
        videos.fail(f.index)  # nothing for an image; a video's earlier pieces are dropped
    if out is not None:
        extras = dict(out.extras)
        vectors = extras.pop("pooled", None)
        tokens = entry_tokens(chunk.videos, len(chunk.grid_thw), launched.tokens)
        pieces = split_per_image(TowerOutput(out.embeddings, extras), tokens)
        if vectors is not None:
            for piece, vector in zip(pieces, vectors):
                piece.extras["pooled"] = vector
        for index, piece, video in zip(chunk.indices, pieces, chunk.videos or [None] * len(pieces)):
            if video is not None:
                enc.tally.add(video_frames=len(video.frames))  # progress of long videos (mmenc encode)
            value = piece if video is None else videos.take(index, video, piece)
            if value is not None:
                items.append((index, value))
    yield from sorted(items, key=lambda pair: pair[0])
