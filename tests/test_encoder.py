"""The Encoder API on a tiny Qwen2.5-VL checkpoint (CPU, fp32): encode / encode_pixels / preprocess agree,
results do not depend on batching, large inputs split into several tower calls, partial failures, extras."""
import numpy as np
import pytest
import torch

from mmenc.engine.encoder import Encoder
from mmenc.preprocess.images import ImageLoadError
from mmenc.testing.checkpoints import random_pixels, save_qwen2_5_vl, save_qwen3_vl


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return str(save_qwen2_5_vl(tmp_path_factory.mktemp("enc"))[0])


@pytest.fixture(scope="module")
def encoder(folder):
    return Encoder(folder, device="cpu")


def _images(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in [(56, 84), (112, 56), (60, 61)]]


def test_encode_matches_encode_pixels_and_preprocess(encoder):
    images = _images()
    per_image = encoder.encode(images)
    pixel_values, grid_thw = encoder.preprocess(images)
    flat = encoder.encode_pixels(pixel_values, grid_thw)
    assert [e.shape[0] for e in per_image] == encoder.output_tokens(grid_thw)
    assert torch.equal(torch.cat(per_image), flat)


def test_batching_does_not_change_results(encoder):
    images = _images(1)
    together = encoder.encode(images)
    for image, want in zip(images, together):
        (alone,) = encoder.encode([image])
        err = float((alone - want).norm() / want.norm())
        assert err < 1e-5, f"image encoded alone differs from in a batch by {err:.2e} (tolerance 1e-5)"
    reversed_out = encoder.encode(images[::-1])[::-1]
    for a, b in zip(reversed_out, together):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_large_inputs_split_into_several_tower_calls(folder):
    grid = torch.tensor([[1, 8, 8], [1, 4, 8], [1, 8, 4], [2, 4, 4]])
    pixels = random_pixels(grid)
    whole = Encoder(folder, device="cpu").encode_pixels(pixels, grid)
    small = Encoder(folder, device="cpu", max_batch_patches=40)  # 64 + 32 + 32 + 32 patches: four calls
    calls = []
    original = small._run
    small._run = lambda pv, g: calls.append(g.shape[0]) or original(pv, g)
    got = small.encode_pixels(pixels, grid)
    assert calls == [1, 1, 1, 1], f"tower calls per chunk: {calls}"
    assert torch.allclose(got, whole, rtol=1e-5, atol=1e-6)


def test_partial_failure_raise_and_skip(encoder, tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"not an image")
    images = [_images()[0], str(bad), _images()[1], np.zeros((0, 5, 3), np.uint8)]
    with pytest.raises(ImageLoadError) as e:
        encoder.encode(images)
    assert "broken.png" in str(e.value) and "image #3" in str(e.value) and "2 of 4" in str(e.value)
    out = encoder.encode(images, errors="skip")
    assert out[1] is None and out[3] is None
    want = encoder.encode([images[0], images[2]])
    assert torch.equal(out[0], want[0]) and torch.equal(out[2], want[1])


def test_bad_pixel_inputs_name_the_problem(encoder):
    with pytest.raises(ValueError, match=r"grid_thw must be \[N, 3\]"):
        encoder.encode_pixels(torch.randn(4, 1176), torch.tensor([1, 2, 2]))
    with pytest.raises(ValueError, match=r"pixel_values has shape \(5, 1176\); grid_thw \[\[1, 2, 2\]\] needs \[4,"):
        encoder.encode_pixels(torch.randn(5, 1176), torch.tensor([[1, 2, 2]]))
    with pytest.raises(ValueError, match="tensor_parallel_size=0"):
        Encoder("Qwen/Qwen2.5-VL-3B-Instruct", device="meta", tensor_parallel_size=0)


def test_extras_split_per_image(tmp_path):
    folder, _ = save_qwen3_vl(tmp_path / "q3")
    enc = Encoder(str(folder), device="cpu")
    images = [_images()[0], _images()[2]]
    pieces = enc.encode(images, return_extras=True)
    flat = enc.encode_pixels(*enc.preprocess(images), return_extras=True)
    assert torch.equal(torch.cat([p.embeddings for p in pieces]), flat.embeddings)
    for level, full in enumerate(flat.extras["deepstack"]):
        assert torch.equal(torch.cat([p.extras["deepstack"][level] for p in pieces]), full)


def test_video_frames(encoder):
    frames = [np.full((56, 56, 3), i * 40, np.uint8) for i in range(4)]
    pixel_values, grid_thw = encoder.preprocess_video(frames)
    (t, h, w), = grid_thw.tolist()
    assert t == 2, f"4 frames with temporal patch 2 should give t=2, got grid {grid_thw.tolist()}"
    assert encoder.encode_pixels(pixel_values, grid_thw).shape[0] == t * h * w // 4


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data", "weights"])
def test_encoder_with_worker_processes_matches_one_process(folder, encoder, mode):
    images = _images(2)
    want = encoder.encode(images)
    with Encoder(folder, device="cpu", tensor_parallel_size=2, mm_encoder_tp_mode=mode) as enc:
        got = enc.encode(images)
        assert enc.attention_backends() == encoder.attention_backends()
    for g, w in zip(got, want):
        err = float((g - w).norm() / w.norm())
        assert err < 1e-5, f"{mode} mode over 2 workers differs from one process by {err:.2e} (tolerance 1e-5)"
