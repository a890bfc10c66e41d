"""The Encoder API on a tiny Qwen2.5-VL checkpoint (CPU, fp32): encode / encode_pixels / preprocess agree,
results do not depend on batching, large inputs split into several tower calls, partial failures, extras,
argument checks, zero images, non-finite outputs, calls from many threads (in process and with workers)."""
import numpy as np
import pytest
import torch

from mmenc.engine.encoder import Encoder
from mmenc.preprocess.images import ImageLoadError
from mmenc.testing.checkpoints import random_pixels, save_qwen3_vl


@pytest.fixture(scope="module")
def encoder(reference):  # conftest's CPU Encoder over it, the one under test here
    return reference


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
    with small.tower_call_hook(lambda run, pv, g: calls.append(g.shape[0]) or run(pv, g)):
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


@pytest.mark.parametrize("kwargs, message", [
    (dict(dtype=torch.int8), r"dtype=torch.int8 is not a floating dtype"),
    (dict(dtype=3), r"dtype=3 is not valid; expected 'auto'"),
    (dict(dtype="int8"), r"dtype='int8' is not valid"),
    (dict(tensor_parallel_size=2.5), r"tensor_parallel_size=2.5 must be an int >= 1"),
    (dict(tensor_parallel_size="2"), r"tensor_parallel_size='2' must be an int >= 1"),
    (dict(tensor_parallel_size=True), r"tensor_parallel_size=True must be an int >= 1"),
    (dict(max_batch_patches=0), r"max_batch_patches=0 must be an int >= 1"),
    (dict(max_batch_patches=1.5), r"max_batch_patches=1.5 must be an int >= 1"),
    (dict(worker_timeout_s=0), r"worker_timeout_s=0 must be a positive, finite number"),
    (dict(worker_timeout_s="60"), r"worker_timeout_s='60' must be a positive, finite number"),
])
def test_encoder_arguments_are_validated(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Encoder("Qwen/Qwen2.5-VL-3B-Instruct", device="meta", **kwargs)


def test_zero_images_give_an_empty_result(encoder, tmp_path):
    assert encoder.encode([]) == []
    out = encoder.encode_pixels(torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.int64))
    assert out.shape == (0, encoder.loaded.config.out_hidden_size) and out.dtype == encoder.loaded.dtype
    folder, _ = save_qwen3_vl(tmp_path / "q3")  # extras keep their structure, empty
    enc = Encoder(str(folder), device="cpu")
    out = enc.encode_pixels(torch.zeros(0, enc.loaded.config.patch_features), torch.zeros(0, 3, dtype=torch.int64),
                            return_extras=True)
    want = enc.encode_pixels(*enc.preprocess(_images()[:1]), return_extras=True)
    assert out.embeddings.shape == (0, want.embeddings.shape[1])
    assert [t.shape[1:] for t in out.extras["deepstack"]] == [t.shape[1:] for t in want.extras["deepstack"]]
    assert all(t.shape[0] == 0 for t in out.extras["deepstack"])


def test_non_finite_embeddings_warn_or_raise(folder, encoder, mmenc_caplog):
    from mmenc.engine.checks import NonFiniteOutputError
    from mmenc.models.base import TowerOutput

    pixel_values, grid = encoder.preprocess(_images())  # 3 images
    tokens = encoder.output_tokens(grid)
    enc = Encoder(folder, device="cpu")

    def poisoned(run, pv, g):  # image 1's first row becomes NaN
        out = run(pv, g)
        emb = out.embeddings.clone()
        emb[tokens[0]] = float("nan")
        return TowerOutput(emb, out.extras)

    with enc.tower_call_hook(poisoned):
        out = enc.encode_pixels(pixel_values, grid)
    assert out.isnan().any()
    assert "non-finite embeddings (NaN or inf) for 1 of 3 image(s)" in mmenc_caplog.text
    assert "image indices in the call: 1)" in mmenc_caplog.text
    strict = Encoder(folder, device="cpu", strict=True, linear_backend="native")  # weights written in place
    with torch.no_grad():
        next(strict.tower.parameters()).fill_(float("nan"))  # NaN weights: every image
    with pytest.raises(NonFiniteOutputError, match=r"for 3 of 3 image\(s\).*indices in the call: 0, 1, 2"):
        strict.encode(_images())


def test_calls_from_many_threads_never_cross(folder, encoder):
    _threads_match_sequential(encoder, _images(3) + _images(4), threads=4, rounds=3)


def _threads_match_sequential(enc, images, threads: int, rounds: int, timeout_s: float = 240.0):
    """`threads` threads each encode their own image `rounds` times at once; every result must equal
    the sequential one (bitwise for the one-process path, 1e-5 relative otherwise)."""
    import threading
    want = [enc.encode([im])[0] for im in images[:threads]]
    results, errors = {}, []

    def work(k):
        try:
            for r in range(rounds):
                results[k, r] = enc.encode([images[k]])[0]
        except BaseException as e:  # reported below with the thread's index
            errors.append((k, repr(e)))

    pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in pool), f"threads still running after {timeout_s}s"
    assert not errors, f"calls from threads failed: {errors}"
    for (k, r), got in results.items():
        assert got.shape == want[k].shape, f"thread {k} round {r}: shape {tuple(got.shape)} != {tuple(want[k].shape)}"
        err = float((got - want[k]).norm() / want[k].norm())
        assert err < 1e-5, f"thread {k} round {r}: differs from its sequential result by {err:.2e} (crossed?)"


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
    with Encoder(folder, device="cpu", tensor_parallel_size=2, mm_encoder_tp_mode=mode, worker_timeout_s=120) as enc:
        assert enc._executor.group.timeout_s == 120 and enc._executor.mode == mode
        got = enc.encode(images)
        assert enc.attention_backends() == encoder.attention_backends()
        assert enc.encode([]) == []
        empty = enc.encode_pixels(torch.zeros(0, 1176), torch.zeros(0, 3, dtype=torch.int64))
        assert empty.shape == (0, encoder.loaded.config.out_hidden_size)
        _threads_match_sequential(enc, _images(3) + _images(4), threads=4, rounds=3)
        assert enc.encode(images)[0].shape == got[0].shape  # the workers are still alive and in step
    for g, w in zip(got, want):
        err = float((g - w).norm() / w.norm())
        assert err < 1e-5, f"{mode} mode over 2 workers differs from one process by {err:.2e} (tolerance 1e-5)"


def test_all_finite_flag_needs_no_tensor_of_the_embeddings_size():
    """all_finite (the finite check of every tower call) is one sum: NaN, +inf and -inf are caught, and it
    allocates nothing the size of the embeddings (torch.isfinite(x).all() made a bool copy: 0.22 GiB on
    Pixtral-Large). Finite values whose sum leaves float32's range raise the flag, and check_finite then
    finds no bad image: no warning, no error."""
    from mmenc.bench.alloc_sim import trace
    from mmenc.engine.checks import all_finite, check_finite

    x = torch.randn(2048, 512)
    assert bool(all_finite(x)) and bool(all_finite(x.bfloat16())) and bool(all_finite(x.half()))
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1000, 7] = bad
        assert not bool(all_finite(y)) and not bool(all_finite(y.bfloat16())), bad
    seq, _ = trace(lambda: all_finite(x))
    biggest = max((n for _, n in seq), default=0)
    assert biggest < x.numel() // 64, f"all_finite allocated {biggest} bytes for a {x.numel()}-element tensor"
    huge = torch.full((4, 8), 3e38)
    assert not bool(all_finite(huge))  # the sum overflows: a false alarm, settled by check_finite
    check_finite(huge, [2, 2], strict=True)  # no NonFiniteOutputError: every value is finite


def test_encode_after_close_raises_a_clear_error(q25):
    """Issue 28 item 13: an Encoder used after close() (or its `with` block) worked silently."""
    from mmenc.engine.encoder import EncoderClosedError

    with Encoder(q25, device="cpu") as enc:
        pixel_values, grid = enc.preprocess(_images()[:1])
        enc.encode(_images()[:1])
    assert enc.closed
    for call in (lambda: enc.encode(_images()[:1]), lambda: list(enc.encode_iter(_images()[:1])),
                 lambda: enc.encode_pixels(pixel_values, grid)):
        with pytest.raises(EncoderClosedError, match=r"encoder is closed .*create a new Encoder"):
            call()
    enc.close()  # still idempotent
