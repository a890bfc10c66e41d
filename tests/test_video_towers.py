"""End to end: a video file through `Encoder.encode` equals transformers' get_video_features on the
same file (transformers' PyAV reader, its video processor, its model; fp32, relative error < 1e-5),
for every family that takes video, on tiny random checkpoints; with the video cut into pieces over
several tower calls. Needs torchvision (transformers' video processors): the torchvision venv of
tests/test_video_parity.py; skips elsewhere."""
import pytest

pytest.importorskip("torchvision")
pytest.importorskip("av")
pytest.importorskip("transformers")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.preprocess.video import Video  # noqa: E402
from mmenc.preprocess.video_decode import probe  # noqa: E402
from mmenc.preprocess.video_sampling import VideoOptions  # noqa: E402
from mmenc.testing import checkpoints as ck  # noqa: E402
from mmenc.testing.clips import write_clip  # noqa: E402
from mmenc.testing.hf_video import hf_call  # noqa: E402

FAMILIES = {  # architecture -> (video kind, options)
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", VideoOptions(fps=4)),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", VideoOptions(fps=4)),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", VideoOptions()),
    "Qwen3OmniMoeForConditionalGeneration": ("qwen3_omni", VideoOptions(num_frames=6)),
    "Glm4vForConditionalGeneration": ("glm4v", VideoOptions()),
    "Kimi_K25ForConditionalGeneration": ("kimi_k25", VideoOptions(fps=5)),
}


def video_features(hf_model, pixel_values, grid_thw):
    """transformers' get_video_features -> (embeddings [tokens, D], deepstack list)."""
    owner = getattr(hf_model, "thinker", hf_model)
    owner = getattr(owner, "model", owner)
    with torch.no_grad():
        out = owner.get_video_features(pixel_values_videos=pixel_values, video_grid_thw=grid_thw)
    pooled = out.pooler_output if hasattr(out, "pooler_output") else out
    embeddings = torch.cat(list(pooled)) if isinstance(pooled, (list, tuple)) else pooled
    deep = getattr(out, "deepstack_features", None) or []
    return embeddings, [torch.cat(list(level)) if isinstance(level, (list, tuple)) else level for level in deep]


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("clip") / "c.mp4", frames=30, size=(58, 84), fps=10, gop=6)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_video_encode_equals_transformers_get_video_features(tmp_path, clip, arch):
    from transformers.video_utils import load_video

    kind, options = FAMILIES[arch]
    folder, hf_model = ck.FAMILIES[arch].save(tmp_path / "ckpt")
    frames, hf_meta = load_video(str(clip), backend="pyav")
    with Encoder(str(folder), device="cpu", dtype="float32", preprocess_workers=1) as enc:
        pv, grid, _, _ = hf_call(kind, {}, frames, probe(clip), options)
        expected, deep = video_features(hf_model, pv, grid)
        (whole,) = enc.encode([Video(clip, **options.as_dict())])
        # the same video in pieces of one temporal unit each, several per tower call
        enc.preprocessor.video_piece_patches = 1
        enc.max_batch_patches = max(1, int(grid[0, 1:].prod()) * (4 if kind == "kimi_k25" else 1) * 2)
        before = enc.tally.snapshot()
        (pieces,) = enc.encode([Video(clip, **options.as_dict())])
        calls = enc.tally.since(before).get("tower_calls", 0)
    assert calls >= 2, f"{arch}: the pieces ran in {calls} tower call(s)"
    assert whole.video.grid_thw == tuple(map(tuple, grid.tolist()))
    for got in (whole, pieces):
        err = ck.relative_error(got.embeddings, expected)
        assert err < 1e-5, f"{arch}: relative error {err:.2e}"
        for ours, theirs in zip(got.extras.get("deepstack") or [], deep):
            assert ck.relative_error(ours, theirs) < 1e-5
    assert len(deep) == len(whole.extras.get("deepstack") or [])
    assert np.asarray(whole.video.frames_indices).min() >= 0
