"""Video decoding, streaming and failures on clips the tests encode (runs without torchvision; the
comparisons with transformers' video processors are tests/test_video_parity.py / test_video_towers.py)."""
import pytest

av = pytest.importorskip("av")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmenc.preprocess import LoadFailure  # noqa: E402
from mmenc.preprocess.pipeline import Preprocessor  # noqa: E402
from mmenc.preprocess.video import Video  # noqa: E402
from mmenc.preprocess.video_decode import VideoDecodeError, looks_like_video, probe  # noqa: E402
from mmenc.preprocess.video_frames import DecodeCursors, decode  # noqa: E402
from mmenc.preprocess.video_families import get_video_processor, video_config_from_files  # noqa: E402
from mmenc.preprocess.video_sampling import VideoOptions  # noqa: E402
from mmenc.preprocess import get_processor  # noqa: E402
from mmenc.testing.clips import FAST_CODECS, write_clip  # noqa: E402


def sequential(path) -> list[np.ndarray]:
    with av.open(str(path)) as c:
        return [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {suffix: write_clip(folder / f"c{suffix}", frames=33, size=(32, 48), fps=10, codec=codec, gop=7)
            for suffix, codec in FAST_CODECS}


@pytest.mark.parametrize("suffix", [s for s, _ in FAST_CODECS])
def test_seeking_decode_gives_the_counted_frames(clips, suffix):
    """H.264 with B-frames (MP4, MOV), VP9 in WebM, MPEG-4 in Matroska and AVI: one seek per call, the
    frames of a decode from the start."""
    path = clips[suffix]
    meta = probe(path)
    frames = sequential(path)
    assert meta.total_num_frames == len(frames) == 33 and meta.fps == 10 and (meta.height, meta.width) == (32, 48)
    for picks in ([0], [5, 6, 7], [13, 20, 32], [32], [1, 1, 8]):
        assert np.array_equal(decode(path, picks, meta), np.stack([frames[i] for i in picks])), picks


def test_cursors_go_on_from_the_previous_piece(clips):
    """A video's pieces through one DecodeCursors: each goes on from the last (or seeks when behind it),
    the frames of a decode from the start; the decoder is closed after the last piece."""
    path = clips[".mp4"]
    meta, frames = probe(path), sequential(path)
    cursors = DecodeCursors()
    for picks, keep in (([2, 4], True), ([6, 9], True), ([9, 20], True), ([1, 3], True), ([31, 32], False)):
        got = decode(path, picks, meta, cursors=cursors, key="v", keep=keep)
        assert np.array_equal(got, np.stack([frames[i] for i in picks])), picks
        assert ("v" in cursors._idle) == keep
    assert not cursors._busy


def test_lanes_start_after_key_frames_and_pieces_keep_to_them(tmp_path):
    """A 12 s clip with a key frame every 25 frames, sampled at 5 fps: lanes start at the first unit past a
    key frame (from the index, no decoding), about equal, never more than asked; each lane's pieces are
    consecutive and only its last closes the decoder; without key frames lanes are LANE_MIN_SECONDS long."""
    import dataclasses

    from mmenc.preprocess.video import LANE_MIN_SECONDS, video_lanes

    clip = write_clip(tmp_path / "k.mp4", frames=120, size=(32, 48), fps=10, codec="libx264", gop=25)
    meta = probe(clip)
    assert meta.keyframes[0] == 0 and len(meta.keyframes) >= 4
    vp = get_video_processor("qwen2_5_vl")
    plan = vp.plan(meta, VideoOptions(fps=5))  # 60 frames, 30 units of 2 frames, every other source frame
    for lanes in (1, 2, 3, 4, 64):
        bounds = video_lanes(plan, lanes)
        assert bounds[0] == 0 and bounds[-1] == plan.units and bounds == sorted(set(bounds))
        assert len(bounds) - 1 <= min(lanes, len(meta.keyframes))
        for u in bounds[1:-1]:  # a lane's first frame is just past a key frame
            first = plan.indices[u * plan.unit_frames]
            assert any(0 <= first - k - 8 < 2 * plan.unit_frames for k in meta.keyframes), (u, first, meta.keyframes)
    assert 4 <= len(video_lanes(plan, 64)) - 1 <= len(meta.keyframes)  # a key frame near the end adds none
    pieces = vp.pieces(clip, "k", plan, max_rows=2 * plan.unit_rows, video_id="v", lanes=3)
    assert [p.lane for p in pieces] == sorted(p.lane for p in pieces) and pieces[-1].lane == 2
    assert [p.lane_last for p in pieces] == [a.lane != b.lane for a, b in zip(pieces, pieces[1:])] + [True]
    assert sum(len(p.frames) for p in pieces) == len(plan.indices)
    whole, _, _ = vp(clip, VideoOptions(fps=5))
    cursors = DecodeCursors()
    got = vp.finish([vp.prepare_piece(p, cursors) for p in pieces], [p.plan for p in pieces])[0]
    assert torch.equal(got, whole) and not cursors._idle  # every lane's decoder closed after its last piece
    bare = dataclasses.replace(plan, metadata=dataclasses.replace(meta, keyframes=()))
    assert meta.duration < 2 * LANE_MIN_SECONDS and video_lanes(bare, 64) == [0, 30]
    longer = dataclasses.replace(bare, metadata=dataclasses.replace(bare.metadata, duration=2.5 * LANE_MIN_SECONDS))
    assert video_lanes(longer, 64) == [0, 15, 30] and video_lanes(longer, 1) == [0, 30]


@pytest.mark.parametrize("suffix", [".mp4", ".webm"])
def test_unwanted_frames_skip_the_decoder_where_nothing_refers_to_them(clips, suffix):
    """H.264: packets of frames not wanted before the last wanted one go with skip_frame NONREF (B-frames
    nothing refers to are not decoded); the frames are still the counting reader's. VP9: nothing skipped."""
    path = clips[suffix]
    meta, frames = probe(path), sequential(path)
    cursors = DecodeCursors()
    for picks in ([0, 1, 30], [31, 32]):
        got = decode(path, picks, meta, cursors=cursors, key="v", keep=True)
        assert np.array_equal(got, np.stack([frames[i] for i in picks])), picks
    skips = cursors._idle["v"].skips
    assert skips > 0 if suffix == ".mp4" else skips == 0
    cursors.clear()


def test_video_detection(clips):
    assert looks_like_video("a/b.MP4") and looks_like_video(clips[".mkv"]) and not looks_like_video("a.jpg")
    for suffix in (".mp4", ".webm", ".avi", ".mov"):
        assert looks_like_video(clips[suffix].read_bytes()), suffix
    assert not looks_like_video(b"\x89PNG\r\n\x1a\n" + bytes(40))


def test_decode_errors_name_the_file_and_frame(clips, tmp_path):
    data = clips[".mp4"].read_bytes()
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(data[:len(data) // 2])  # the index (moov) survives at the end? not here: unreadable
    broken = tmp_path / "broken.mkv"
    raw = bytearray(clips[".mkv"].read_bytes())
    broken.write_bytes(bytes(raw[:len(raw) * 2 // 3]))  # Matroska streams: the frames after the cut are missing
    with pytest.raises(VideoDecodeError, match="cut.mp4"):
        meta = probe(cut, "'cut.mp4'")
        decode(cut, [30], meta, "'cut.mp4'")
    meta = probe(clips[".mkv"])  # the full file's header: 33 frames
    with pytest.raises(VideoDecodeError, match=r"broken\.mkv.*frame \d+ \(t=\d+\.\d+ s\)"):
        decode(broken, [32], meta, "'broken.mkv'")
    with pytest.raises(VideoDecodeError, match="not a readable video"):
        probe(b"\x00\x00\x00\x18ftypmp42" + bytes(100), "video #0")
    with pytest.raises(VideoDecodeError, match="no such file"):
        probe(tmp_path / "missing.mp4", "'missing.mp4'")


def test_options_are_checked():
    with pytest.raises(ValueError, match="exclude each other"):
        VideoOptions(fps=2, num_frames=8)
    with pytest.raises(ValueError, match="fps=0"):
        VideoOptions(fps=0)
    vp = get_video_processor("glm4v")
    with pytest.raises(ValueError, match="max_frames=4 is not a setting.*takes fps"):
        vp.plan(probe_meta(), VideoOptions(max_frames=4), "'v.mp4'")
    with pytest.raises(ValueError, match="takes no video"):
        get_video_processor("siglip")


def probe_meta():
    from mmenc.preprocess.video_decode import VideoMetadata

    return VideoMetadata(total_num_frames=40, fps=10.0, duration=4.0, height=32, width=48)


def test_video_config_follows_transformers_file_order():
    image, video = {"max_pixels": 1}, {"max_pixels": 2}
    assert video_config_from_files({"video_processor": {"max_pixels": 3}}, video, image) == {"max_pixels": 3}
    assert video_config_from_files({}, video, image) == video
    assert video_config_from_files(None, {}, image) == image  # no video file: the image processor's file


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_pipeline_pieces_equal_the_whole_video(clips, kind):
    """Pieces of one temporal unit, over several chunks, prepared by worker threads or processes: the
    pixels of the processor's own whole-video call; a bad video fails alone, named."""
    vp = get_video_processor("qwen2_5_vl")
    whole, grid, info = vp(clips[".webm"], VideoOptions(fps=5))
    items = [Video(clips[".webm"], fps=5), "missing.mp4", clips[".mp4"]]
    with Preprocessor(get_processor("qwen2_5_vl"), workers=2, worker_kind=kind, video_processor=vp,
                      video_piece_patches=1) as pre:
        chunks = list(pre.iter_chunks(items, max_batch_patches=3 * int(grid[0, 1:].prod()), errors="skip"))
    assert len(chunks) > 2
    first = [(c.pixel_values[sum(int(r.prod()) for r in c.grid_thw[:k]):][:int(c.grid_thw[k].prod())], v)
             for c in chunks for k, (i, v) in enumerate(zip(c.indices, c.videos)) if i == 0]
    assert [v.piece for _, v in first] == list(range(first[0][1].pieces)) and first[0][1].info == info
    assert torch.equal(torch.cat([pv for pv, _ in first]), whole)
    failures = [f for c in chunks for f in c.failures]
    assert [(f.index, f.name) for f in failures] == [(1, "'missing.mp4'")] and "no such file" in failures[0].message
    assert {i for c in chunks for i in c.indices} == {0, 2}


def test_a_batch_of_one_path_many_times_finishes_and_equals_each_alone(tmp_path, monkeypatch):
    """Six copies of one path in worker processes (each copy its own video: its own pieces and decoder):
    every copy's pixels are the clip's alone. The workers here keep no released segment (as when video
    pieces of tens of MB overflow what they keep), so each release destroys one and tells the parent;
    reading such a notice blocked the parent's receiver on that worker, and the batch never finished
    (issue 26: 16 x a 60 s clip)."""
    import functools
    import threading

    from mmenc.preprocess import pipeline, procs

    monkeypatch.setattr(pipeline, "ProcessWorkers", functools.partial(procs.ProcessWorkers, keep_free_bytes=0))
    clip = write_clip(tmp_path / "c.mp4", frames=40, size=(64, 96), fps=10, codec="libx264", gop=12)
    vp = get_video_processor("qwen2_5_vl")
    whole, grid, _ = vp(clip, VideoOptions(fps=5))  # 20 frames, 10 units
    chunks, n = [], 6
    with Preprocessor(get_processor("qwen2_5_vl"), workers=3, worker_kind="process", video_processor=vp,
                      video_piece_patches=2 * int(grid[0, 1:].prod())) as pre:
        run = threading.Thread(target=lambda: chunks.extend(pre.iter_chunks(
            [Video(clip, fps=5)] * n, max_batch_patches=6 * int(grid[0, 1:].prod()))), daemon=True)
        run.start()
        run.join(timeout=120)
        assert not run.is_alive(), f"the batch did not finish in 120 s ({len(chunks)} chunks came)"
    rows = whole.shape[0]
    got = torch.cat([c.pixel_values for c in chunks])
    assert [i for c in chunks for i in c.indices] == sorted(i for c in chunks for i in c.indices)
    assert got.shape[0] == n * rows
    for k in range(n):
        assert torch.equal(got[k * rows:(k + 1) * rows], whole), k


def test_encoder_streams_a_video_and_skips_a_bad_one(tmp_path, clips):
    """Encoder.encode / encode_iter: a video in pieces over several tower calls equals one call; a file that
    does not decode is a per-item failure (encode(errors="skip") -> None, encode_iter -> LoadFailure)."""
    pytest.importorskip("transformers")
    from mmenc.engine.encoder import Encoder
    from mmenc.engine.videos import VideoEmbedding
    from mmenc.testing import checkpoints as ck

    folder, _ = ck.save_qwen2_5_vl(tmp_path / "ckpt")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypisom" + bytes(64))
    video = Video(clips[".mp4"], fps=4)
    with Encoder(str(folder), device="cpu", dtype="float32", preprocess_workers=2, batch_invariant=True) as enc:
        (one,) = enc.encode([video])
        enc.preprocessor.video_piece_patches = 1
        enc.max_batch_patches = 2 * int(one.grid_thw[0, 1:].prod())
        before = enc.tally.snapshot()
        got = enc.encode([bad, video, np.zeros((28, 28, 3), np.uint8)], errors="skip")
        assert enc.tally.since(before)["tower_calls"] >= 3
        streamed = list(enc.encode_iter([video, bad]))
    assert isinstance(one, VideoEmbedding) and one.video.grid_thw == ((6, 20, 28),) and one.video.second_per_grid_ts
    assert got[0] is None and isinstance(got[1], VideoEmbedding) and isinstance(got[2], torch.Tensor)
    assert torch.equal(got[1].embeddings, one.embeddings)  # batch_invariant: bitwise whatever the cut
    assert [i for i, _ in streamed] == [0, 1] and isinstance(streamed[1][1], LoadFailure)
    assert "bad.mp4" in streamed[1][1].message and torch.equal(streamed[0][1].embeddings, one.embeddings)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["thread", "process"])
def test_pipeline_on_cuda_gives_the_cpu_pixels(clips, kind):
    """Video pieces staged to a GPU (uint8 across, patchify + normalize there, side stream): the CPU's values."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    vp = get_video_processor("qwen3_vl")
    whole, _, _ = vp(clips[".mp4"], VideoOptions(fps=5))
    with Preprocessor(get_processor("qwen3_vl"), device="cuda", workers=2, worker_kind=kind, video_processor=vp,
                      video_piece_patches=1) as pre:
        chunks = list(pre.iter_chunks([Video(clips[".mp4"], fps=5)], max_batch_patches=1 << 12))
    got = torch.cat([c.pixel_values for c in chunks])
    assert got.device.type == "cuda" and torch.equal(got.cpu(), whole)


def test_assembler_fills_the_video_output_and_lets_each_chunk_output_go():
    """A video in pieces: VideoAssembler (given tokens_of) writes each piece into the video's output as it
    comes, so no chunk output stays alive for a held view (the device memory beyond a long video's own
    embeddings stays one chunk's); the result equals the pieces joined; a piece count that does not add up
    to the grid's rows is an error, not a wrong answer."""
    import types
    import weakref

    from mmenc.engine.outputs import ImageEmbedding
    from mmenc.engine.videos import VideoAssembler

    info = types.SimpleNamespace(grid_thw=((3, 2, 2),))  # 3 temporal rows of 2x2 -> 12 embedding rows
    tokens_of = lambda rows: sum(t * h * w for t, h, w in rows)  # noqa: E731
    gen = torch.Generator().manual_seed(0)
    assembler, views, alive, got = VideoAssembler(tokens_of), [], [], None
    for i in range(3):
        chunk = torch.randn(7, 5, generator=gen)  # the piece's 4 rows beside 3 rows of another image
        views.append(chunk[:4].clone())
        alive.append(weakref.ref(chunk))
        piece = types.SimpleNamespace(last=i == 2, info=info)
        got = assembler.take(0, piece, ImageEmbedding(chunk[:4], {"deepstack": [chunk[:4] * 2]}))
        del chunk
        assert alive[-1]() is None, "the assembler kept a view of a chunk output"
    assert torch.equal(got.embeddings, torch.cat(views))
    assert torch.equal(got.extras["deepstack"][0], torch.cat(views) * 2)

    short = VideoAssembler(lambda rows: 10)
    first = types.SimpleNamespace(last=False, info=info)
    short.take(1, first, ImageEmbedding(torch.zeros(4, 5), {}))
    with pytest.raises(RuntimeError, match="more than the 10 embedding rows"):
        short.take(1, first, ImageEmbedding(torch.zeros(8, 5), {}))
