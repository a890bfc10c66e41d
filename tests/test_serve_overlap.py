"""The batcher keeps the device busy: the next tower call is launched before the previous call's
results are handed back; size buckets for CUDA graphs; the uint8 preprocessing path equals the
processor's float path bitwise; torch.save templates load as the tensor they were given."""
import base64
import io
import threading
import time
import zipfile

import pytest
import torch

pytest.importorskip("prometheus_client")

from serve_client import png  # noqa: E402

from mmenc.models.base import TowerOutput  # noqa: E402
from mmenc.preprocess import get_processor  # noqa: E402
from mmenc.serving.batcher import Batcher, Job, bucket  # noqa: E402
from mmenc.serving.inputs import ItemError  # noqa: E402
from mmenc.serving.metrics import ServeMetrics  # noqa: E402
from mmenc.serving.preprocess import has_per_image_api, normalize_rows, preprocess_image  # noqa: E402
from mmenc.serving.b64 import b64encode  # noqa: E402
from mmenc.serving.tensor_bytes import TensorSaver  # noqa: E402


def _tokens(grid_thw):
    return (grid_thw.prod(-1) // 4).tolist()


def _output(grid_thw, value: float = 1.0) -> TowerOutput:
    rows = int(grid_thw.prod(-1).sum()) // 4
    return TowerOutput(torch.full((rows, 3), value))


def _job(side: int, value: float = 0.0) -> Job:
    return Job(torch.full((side * side, 8), value), torch.tensor([[1, side, side]]))


def test_next_call_is_launched_before_the_previous_results_are_handed_back():
    """The completer of call 1 waits (in output_tokens) until call 2 has been launched: a batcher that
    hands call 1 back before launching call 2 would never get there (the wait times out)."""
    launched, second = [], threading.Event()
    seen_by_completer = []

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        launched.append(time.perf_counter())
        if len(launched) == 2:
            second.set()
        return _output(grid_thw, float(len(launched)))

    def output_tokens(grid_thw):
        if not seen_by_completer:
            seen_by_completer.append(second.wait(timeout=10))
        return _tokens(grid_thw)

    batcher = Batcher(encode_pixels, output_tokens, max_batch_patches=16, max_wait_ms=1, metrics=ServeMetrics())
    first = batcher.submit(_job(4))
    deadline = time.perf_counter() + 10
    while not launched and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert not first.done(), "call 1 was handed back before call 2 could be launched"
    second_future = batcher.submit(_job(4))
    one, two = first.result(timeout=20), second_future.result(timeout=20)
    batcher.close(timeout=10)
    assert seen_by_completer == [True], "call 2 was not launched while call 1 waited to be handed back"
    assert torch.equal(one.full, torch.full((4, 3), 1.0)) and torch.equal(two.full, torch.full((4, 3), 2.0))


def test_at_most_max_in_flight_calls_are_launched_and_not_handed_back():
    release, launched = threading.Event(), []

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        launched.append(grid_thw.shape[0])
        return _output(grid_thw)

    def output_tokens(grid_thw):
        release.wait(timeout=10)
        return _tokens(grid_thw)

    batcher = Batcher(encode_pixels, output_tokens, max_batch_patches=16, max_wait_ms=0, metrics=ServeMetrics(),
                      max_in_flight=2)
    futures = []
    for _ in range(4):
        futures.append(batcher.submit(_job(4)))
        time.sleep(0.05)
    time.sleep(0.2)
    assert len(launched) == 2, f"{len(launched)} calls launched while none could be handed back (limit 2)"
    release.set()
    assert all(f.result(timeout=20).num_tokens == 4 for f in futures)
    batcher.close(timeout=10)
    assert len(launched) == 4


def test_bucket_cuts_each_size_to_a_power_of_two_in_size_order():
    jobs = [_job(4) for _ in range(7)] + [_job(2) for _ in range(3)] + [_job(6)]
    jobs = [jobs[i] for i in (0, 7, 1, 2, 8, 3, 10, 4, 5, 9, 6)]  # sizes interleaved in arrival order
    run, rest = bucket(jobs)
    assert [j.size_key for j in run] == [(1, 2, 2)] * 2 + [(1, 4, 4)] * 4 + [(1, 6, 6)]
    assert [j.size_key for j in rest] == [(1, 4, 4), (1, 4, 4), (1, 2, 2), (1, 4, 4)]  # arrival order kept
    assert {id(j) for j in run} | {id(j) for j in rest} == {id(j) for j in jobs}
    assert run[2] is jobs[0], "the earliest images of a size go first"


def test_bucketed_batcher_reuses_few_packings():
    calls = []

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        calls.append(grid_thw.shape[0])
        return _output(grid_thw)

    metrics = ServeMetrics()
    # the call closes when 7 images of 16 patches are queued; bucketed: 4, then the 3 left as 2 + 1
    batcher = Batcher(encode_pixels, _tokens, max_batch_patches=7 * 16, max_wait_ms=2000, metrics=metrics, bucket=True)
    futures = [batcher.submit(_job(4, float(i))) for i in range(7)]
    results = [f.result(timeout=20) for f in futures]
    batcher.close(timeout=10)
    assert calls == [4, 2, 1], calls
    assert len(batcher.packings) == 3 and b"mmenc_tower_packings 3.0" in metrics.render()
    assert all(r.num_tokens == 4 for r in results)


def test_tower_failure_frees_the_slot_and_fails_only_that_call():
    state = {"n": 0}

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        state["n"] += 1
        if state["n"] == 1:
            raise RuntimeError("device lost")
        return _output(grid_thw)

    batcher = Batcher(encode_pixels, _tokens, 16, 0, ServeMetrics(), max_in_flight=1)
    with pytest.raises(RuntimeError, match="device lost"):
        batcher.submit(_job(4)).result(timeout=10)
    assert batcher.submit(_job(4)).result(timeout=10).num_tokens == 4
    batcher.close(timeout=10)


def test_non_finite_output_goes_through_check_finite_in_the_completer():
    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        out = _output(grid_thw)
        out.embeddings[0, 0] = float("nan")
        return out

    def check_finite(embeddings, tokens):
        raise ValueError(f"non-finite rows in {len(tokens)} image(s); shape {tuple(embeddings.shape)}")

    batcher = Batcher(encode_pixels, _tokens, 16, 0, ServeMetrics(), check_finite=check_finite)
    with pytest.raises(ValueError, match=r"non-finite rows in 1 image\(s\); shape \(4, 3\)"):
        batcher.submit(_job(4)).result(timeout=10)
    batcher.close(timeout=10)


@pytest.mark.parametrize("kind,overrides", [("qwen2_vl", {}), ("qwen3_vl", {}), ("kimi_k25", {}),
                                            ("qwen2_vl", {"backend": "pil"})])
def test_uint8_path_equals_the_processors_float_path_bitwise(kind, overrides):
    processor = get_processor(kind, **overrides)
    assert has_per_image_api(processor)
    for i, (h, w) in enumerate([(56, 56), (61, 90), (200, 33)]):
        data = png(h, w, seed=40 + i)
        want, want_grid = processor([data])
        patches, grid = preprocess_image(processor, data, 0, 1 << 30, uint8=True)
        assert patches.dtype == torch.uint8 and torch.equal(grid, want_grid)
        got = normalize_rows(processor, patches)
        assert got.shape == want.shape and torch.equal(got, want), f"{kind} {h}x{w}"


def test_uint8_path_keeps_the_per_image_failure_contract():
    processor = get_processor("qwen2_vl")
    bad = preprocess_image(processor, b"not an image", 3, 1 << 30, uint8=True)
    assert isinstance(bad, ItemError) and bad.kind == "invalid_image" and bad.message.startswith("images[3]:")
    wide = preprocess_image(processor, png(28, 28 * 201, seed=1), 2, 1 << 30, uint8=True)
    assert isinstance(wide, ItemError) and wide.kind == "unsupported_image" and "images[2]:" in wide.message
    big = preprocess_image(processor, png(64, 64, seed=2), 0, 64 * 63, uint8=True)
    assert isinstance(big, ItemError) and big.kind == "image_too_large"


@pytest.mark.parametrize("tensor", [torch.randn(256, 96).to(torch.bfloat16), torch.randn(7, 5), torch.randn(3, 4).half(),
                                    torch.tensor([[1, 32, 32]])], ids=["bf16", "fp32", "fp16", "int64-grid"])
def test_template_save_loads_as_the_tensor_with_valid_crcs(tensor):
    saver = TensorSaver(max_templates=2)
    for t in (tensor, tensor * 2 if tensor.is_floating_point() else tensor + 1):  # same template, new bytes
        raw = saver.save_bytes(t)
        back = torch.load(io.BytesIO(raw), weights_only=True)
        assert back.dtype == t.dtype and torch.equal(back, t)
        assert zipfile.ZipFile(io.BytesIO(bytes(raw))).testzip() is None, "a record's CRC-32 is wrong"


@pytest.mark.parametrize("tensor", [torch.randn(256, 3584).to(torch.bfloat16), torch.tensor([[1, 32, 32]])]
                         + [torch.arange(n, dtype=torch.uint8) for n in range(1, 9)],
                         ids=lambda t: f"{t.dtype}-{list(t.shape)}")
def test_save_pieces_concatenate_in_base64_and_share_the_tensor_memory(tensor):
    saver = TensorSaver()
    pieces = saver.save_pieces(tensor)
    whole = b"".join(bytes(p) for p in pieces)
    assert whole == saver.save_bytes(tensor)
    assert all(len(p) % 3 == 0 for p in pieces[:-1]), [len(p) for p in pieces]
    assert b"".join(b64encode(p) for p in pieces) == base64.b64encode(whole)
    assert torch.equal(torch.load(io.BytesIO(whole), weights_only=True), tensor)
    assert zipfile.ZipFile(io.BytesIO(whole)).testzip() is None
    if tensor.numel() * tensor.element_size() > 64:  # the middle piece is a view, not a copy
        assert isinstance(pieces[1], memoryview) and len(pieces[1]) > 0.9 * tensor.numel() * tensor.element_size()


def test_body_joins_small_fragments_and_keeps_large_ones():
    from mmenc.serving.formats import Body

    big = b"x" * 100
    body = Body(big=50)
    body.add(b"{", b'"a":')
    body.add(big, b",", big)
    body.add(b"}")
    pieces = body.done()
    assert pieces == [b'{"a":', big, b",", big, b"}"] and pieces[1] is big
    assert Body().done() == []


def test_pending_answers_once_all_items_settle_and_cancels_its_jobs():
    import concurrent.futures

    from mmenc.serving.pending import Pending

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = Pending(2, lambda items: list(items))
        pending.settle(1, "b", pool)
        assert not pending.answer.done()
        pending.settle(0, "a", pool)
        assert pending.answer.result(timeout=5) == ["a", "b"]

        failing = Pending(1, lambda items: 1 / 0)
        failing.settle(0, "a", pool)
        with pytest.raises(ZeroDivisionError):
            failing.answer.result(timeout=5)

        left = Pending(2, lambda items: items)
        queued = left.track(concurrent.futures.Future())
        assert left.cancel() == 2 and queued.cancelled() and left.answer.cancelled()
        late = left.track(concurrent.futures.Future())
        assert late.cancelled()  # a job submitted after the client left is dropped at once
        left.settle(0, "a", pool)
        left.settle(1, "b", pool)  # settling after cancel answers nothing and raises nothing


@pytest.mark.parametrize("fast", [False, True], ids=["stdlib-sliced", "pybase64"])
def test_service_base64_equals_the_standard_library(fast, monkeypatch):
    from mmenc.serving import b64

    if fast:
        pytest.importorskip("pybase64")
    else:
        monkeypatch.setattr(b64, "_fast", None)
    assert b64.encoder_name() == ("pybase64" if fast else "binascii")
    data = bytes(range(256)) * 3000  # 768,000 bytes: several 192 KiB slices and a short tail
    for n in (0, 1, 2, 3, 196607, 196608, 196609, len(data)):
        assert b64encode(data[:n]) == base64.b64encode(data[:n]), n
    words = torch.arange(6, dtype=torch.bfloat16).view(torch.uint8).numpy()  # a buffer, as formats.py passes
    assert b64encode(words.data) == base64.b64encode(words.tobytes())
    good = base64.b64encode(data[:1000])
    assert b64.b64decode(good) == data[:1000] and b64.b64decode(good.decode()) == data[:1000]
    for bad in ("aGVsbG8", "aGVs bG8=", "aGVsbG8=\n", "!!!!", "YQ==YQ==", "a", "\u00e9"):
        with pytest.raises(ValueError) as refused:  # binascii.Error is a ValueError
            b64.b64decode(bad)
        with pytest.raises(ValueError) as stdlib:
            base64.b64decode(bad, validate=True)
        assert str(refused.value) == str(stdlib.value), bad


@pytest.mark.gpu
def test_cuda_call_is_queued_while_the_previous_one_runs():
    """A fake tower that keeps the GPU busy ~200 ms per call: call 2 is launched while call 1's
    kernels still run (its event not reached yet), and both come back right."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ends, running_at_launch = [], []

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        if ends:
            running_at_launch.append(not ends[-1].query())  # the previous call's kernels still running?
        x = pixel_values.to("cuda", non_blocking=True)
        torch.cuda._sleep(int(2e8))
        ends.append(torch.cuda.Event())
        ends[-1].record()
        return TowerOutput(x[:, :3].reshape(-1, 4, 3)[:, 0].contiguous())

    batcher = Batcher(encode_pixels, _tokens, 16, 0, ServeMetrics(), pin_memory=True, device="cuda")
    jobs = [_job(4, float(i)) for i in range(3)]
    results = [f.result(timeout=60) for f in [batcher.submit(j) for j in jobs]]
    batcher.close(timeout=10)
    assert any(running_at_launch), f"no call was launched while the previous one ran: {running_at_launch}"
    for i, r in enumerate(results):
        assert torch.equal(r.full, torch.full((4, 3), float(i)))


def test_asynchronous_tower_call_equals_encode_pixels(tmp_path):
    """The call the batcher uses on accelerator towers (Encoder.launch, finiteness checked later) gives the
    same embeddings as Encoder.encode_pixels, here on the CPU; a call over the Encoder's max_batch_patches
    still splits. On the CPU the batcher itself takes encode_pixels (asynchronous_tower_call is None)."""
    from mmenc.engine.encoder import Encoder
    from mmenc.serving.launch import asynchronous_tower_call, use_buckets
    from mmenc.serving.settings import ServeSettings
    from mmenc.testing.checkpoints import save_qwen2_5_vl

    enc = Encoder(str(save_qwen2_5_vl(tmp_path)[0]), device="cpu", max_batch_patches=32)
    assert asynchronous_tower_call(enc) is None  # the CPU: launch would return done anyway
    encode, finite = enc.launch, enc.check_finite
    for images in ([png(56, 56, seed=1)], [png(56, 56, seed=1), png(84, 112, seed=2)]):  # 16 patches, then 16 + 48 > 32
        pixel_values, grid = enc.preprocess(images)
        want = enc.encode_pixels(pixel_values, grid, return_extras=True)
        got = encode(pixel_values, grid)
        assert torch.equal(got.embeddings, want.embeddings)
    finite(want.embeddings, enc.output_tokens(grid))  # finite: no warning, no error
    assert use_buckets(ServeSettings(), enc) is False and use_buckets(ServeSettings(bucket_batches="on"), enc)
    with pytest.raises(ValueError, match="bucket_batches='maybe'"):
        ServeSettings(bucket_batches="maybe")


def test_uint8_jobs_are_prepared_once_per_call_in_arrival_order():
    """The batcher gathers uint8 jobs into one tensor and `prepare`s it (on CUDA: normalize on the
    device) before the tower; each image gets its own rows back."""
    processor = get_processor("qwen2_vl")
    images = [png(56, 56, seed=60), png(56, 84, seed=61)]  # 16 and 24 patches
    prepared, seen = [], []

    def prepare(patches):
        prepared.append((patches.dtype, patches.shape[0]))
        return normalize_rows(processor, patches)

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        seen.append(pixel_values)
        return TowerOutput(pixel_values[:, :3].reshape(-1, 4, 3)[:, 0].contiguous())

    batcher = Batcher(encode_pixels, _tokens, max_batch_patches=16 + 24, max_wait_ms=2000, metrics=ServeMetrics(),
                      prepare=prepare)
    jobs = [Job(*preprocess_image(processor, data, i, 1 << 30, uint8=True)) for i, data in enumerate(images)]
    results = [f.result(timeout=20) for f in [batcher.submit(j) for j in jobs]]
    batcher.close(timeout=10)
    want, _ = processor(images)
    assert prepared == [(torch.uint8, 40)] and torch.equal(seen[0], want)
    rows = want[:, :3].reshape(-1, 4, 3)[:, 0]
    assert torch.equal(results[0].full, rows[:4]) and torch.equal(results[1].full, rows[4:])


def test_close_runs_the_carried_images_in_calls_within_the_limit():
    calls = []
    release = threading.Event()

    def encode_pixels(pixel_values, grid_thw, return_extras=True):
        release.wait(timeout=10)
        calls.append(int(grid_thw.prod(-1).sum()))
        return _output(grid_thw)

    batcher = Batcher(encode_pixels, _tokens, max_batch_patches=48, max_wait_ms=0, metrics=ServeMetrics(),
                      bucket=True, max_in_flight=1)
    futures = [batcher.submit(_job(4)) for _ in range(8)]  # 16 patches each: 3 fit, bucketed to 2
    closer = threading.Thread(target=batcher.close, kwargs={"timeout": 20})
    closer.start()
    release.set()
    assert all(f.result(timeout=20).num_tokens == 4 for f in futures)
    closer.join()
    assert sum(calls) == 8 * 16 and max(calls) <= 48, calls
