"""Video preprocessing against transformers' own video processors, on clips these tests encode.

transformers' video processors need torchvision, which does not import beside the main venv's CPU
torch: these run in a venv with torch + torchvision (.ci/run builds it; `python3 -m venv
/work/venvs/tv && /work/venvs/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers av
pytest`) and skip cleanly elsewhere. Compared: the sampled frame indices, the pixel values (bitwise),
grid_thw, and the timing transformers' processors derive for the prompt (timestamps, seconds per grid).
"""
import pytest

pytest.importorskip("torchvision")
pytest.importorskip("av")
transformers = pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmenc.preprocess.video_decode import probe  # noqa: E402
from mmenc.preprocess.video_frames import decode  # noqa: E402
from mmenc.preprocess.video_families import get_video_processor  # noqa: E402
from mmenc.preprocess.video_sampling import VideoOptions  # noqa: E402
from mmenc.testing.clips import FAST_CODECS, write_clip  # noqa: E402
from mmenc.testing.hf_video import hf_call  # noqa: E402


CASES = [  # kind, video config, options
    ("qwen2_5_vl", {}, VideoOptions()),
    ("qwen2_5_vl", {}, VideoOptions(fps=3)),
    ("qwen2_5_vl", {"min_pixels": 3136, "max_pixels": 12845056}, VideoOptions(num_frames=6)),  # image bounds
    ("qwen2_vl", {"max_pixels": 64 * 28 * 28}, VideoOptions(fps=4, max_frames=6)),
    ("qwen3_omni", {}, VideoOptions(fps=2)),
    ("qwen3_vl", {}, VideoOptions()),
    ("qwen3_vl", {}, VideoOptions(fps=5, max_frames=9)),
    ("qwen3_vl", {"size": {"shortest_edge": 4096, "longest_edge": 8 * 32 * 32 * 3}}, VideoOptions(num_frames=7)),
    ("glm4v", {}, VideoOptions()),
    ("glm4v", {}, VideoOptions(fps=1)),
    ("kimi_k25", {}, VideoOptions()),
    ("kimi_k25", {"max_patches": 64}, VideoOptions(num_frames=10)),
]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    return {suffix: write_clip(folder / f"c{suffix}", frames=37, size=(46, 62), fps=12, codec=codec, gop=8)
            for suffix, codec in FAST_CODECS[:3]}


@pytest.mark.parametrize("kind,config,options", CASES, ids=lambda v: str(v) if not isinstance(v, dict) else "cfg")
def test_video_matches_transformers(clips, kind, config, options):
    path = clips[".mp4"]
    meta = probe(path)
    all_frames = decode(path, range(meta.total_num_frames), meta)
    vp = get_video_processor(kind, config)
    pixel_values, grid_thw, info = vp(path, options)
    hf_pv, hf_grid, hf_indices, hf_meta = hf_call(kind, config, all_frames, meta, options)
    assert list(info.frames_indices) == hf_indices.tolist()
    assert grid_thw.tolist() == hf_grid.tolist()
    assert pixel_values.shape == hf_pv.shape
    assert torch.equal(pixel_values, hf_pv), f"max |diff| {(pixel_values - hf_pv).abs().max().item()}"
    check_timing(kind, vp, info, hf_meta, options)


def check_timing(kind, vp, info, hf_meta, options):
    """The times transformers' processors put in the prompt, from transformers' own VideoMetadata."""
    tp = vp.config.temporal_patch_size
    if kind == "qwen2_5_vl":
        assert info.second_per_grid_ts == pytest.approx(tp / hf_meta.sampled_fps, rel=1e-12)
    elif kind == "qwen3_omni":
        assert info.second_per_grid_ts == tp / (options.fps if options.fps is not None else 1.0)
    elif kind == "qwen3_vl":
        from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

        expected = Qwen3VLProcessor._calculate_timestamps(None, hf_meta.frames_indices, hf_meta.fps, tp)
        assert list(info.timestamps) == pytest.approx(expected, rel=1e-12)
    elif kind == "glm4v":
        expected = hf_meta.timestamps[::2][:info.grid_thw[0][0]]
        assert list(info.timestamps)[:len(expected)] == pytest.approx(expected, rel=1e-12)
    elif kind == "kimi_k25":
        expected = [hf_meta.timestamps[c * tp] for c in range(len(info.grid_thw))]
        assert list(info.timestamps) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("suffix", [s for s, _ in FAST_CODECS[:3]])
def test_seeking_decode_equals_transformers_pyav_reader(clips, suffix):
    """Our frames (one seek per call) are transformers' PyAV reader's (which decodes from the start)."""
    from transformers.video_utils import read_video_pyav

    path = clips[suffix]
    meta = probe(path)
    picks = [3, 4, 17, 30, 36]
    expected, hf_meta = read_video_pyav(str(path), lambda metadata, **_: np.array(picks))
    if hf_meta.total_num_frames:  # transformers' reader has no frame count for Matroska/WebM
        assert hf_meta.total_num_frames == meta.total_num_frames
    assert np.array_equal(decode(path, picks, meta), expected)


def test_pieces_equal_the_whole_video(clips):
    """A video cut into pieces (each decoded, resized and patchified alone) gives the whole call's pixels."""
    path = clips[".webm"]
    for kind, options in (("qwen2_5_vl", VideoOptions(fps=6)), ("kimi_k25", VideoOptions(fps=6))):
        vp = get_video_processor(kind, {})
        whole, grid, _ = vp(path, options)
        plan = vp.plan(probe(path), options)
        pieces = vp.pieces(path, "clip", plan, max_rows=plan.unit_rows)
        assert len(pieces) == plan.units > 2
        pv, grids = vp.finish([vp.prepare_piece(p) for p in pieces], [p.plan for p in pieces])
        assert torch.equal(pv, whole)
        assert grids[:, 1:].unique(dim=0).tolist() == grid[:1, 1:].tolist() and int(grids[:, 0].sum()) == \
            int(grid[:, 0].sum())
