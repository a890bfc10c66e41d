"""The pipelined Encoder (encode through the Preprocessor, encode_iter) and `mmenc bench --e2e`, on a tiny
Qwen2.5-VL checkpoint on the CPU: stream order, bounded look-ahead on an endless generator, failures
reported with their index while the rest come out, aspect ratio > 200 skipped, the e2e bench end to end."""
import itertools
import json
import math

import numpy as np
import pytest
import torch

from mmenc.cli.main import main
from mmenc.engine.encoder import Encoder
from mmenc.preprocess.images import ImageLoadError, LoadFailure


@pytest.fixture(scope="module")
def encoder(folder):
    with Encoder(folder, device="cpu", preprocess_workers=2, max_batch_patches=64) as enc:
        yield enc


def _image(seed: int, h: int = 56, w: int = 56) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)


def test_stream_keeps_input_order_and_matches_encode(encoder):
    images = [_image(i, 28 * (1 + i % 3), 28 * (1 + (i + 1) % 3)) for i in range(9)]  # mixed sizes, several chunks
    got = list(encoder.encode_iter(iter(images)))
    assert [i for i, _ in got] == list(range(9))
    want = encoder.encode(images)
    for (i, emb), ref in zip(got, want):
        assert torch.equal(emb, ref), f"stream result {i} differs from encode's"
    alone = encoder.encode([images[4]])[0]
    err = float((got[4][1] - alone).norm() / alone.norm())
    assert err < 1e-5, f"image 4 in the stream differs from alone by {err:.2e} (tolerance 1e-5)"


def test_stream_reads_an_endless_generator_only_a_bounded_way_ahead(encoder):
    consumed = 0

    def endless():
        nonlocal consumed
        for i in itertools.count():
            consumed += 1
            yield _image(i % 5)  # 56x56: 16 patches; max_batch_patches=64 -> 4 images a chunk

    stream = encoder.encode_iter(endless())
    ahead = []
    for n, (index, emb) in enumerate(itertools.islice(stream, 30)):
        assert index == n and emb.shape[0] == 4
        ahead.append(consumed - (n + 1))
    stream.close()
    # workers=2, 4 images a chunk: at most 8 images queued (prefetch_chunks=2 chunks of 64 patches) + the
    # chunk being filled + the chunk the tower ran + the rest of the chunk being handed out: 20 images
    assert max(ahead) <= 20, f"the stream read up to {max(ahead)} images beyond the last result (bound 20)"


def test_failing_images_in_a_stream_are_reported_with_their_index(encoder, tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not a jpeg")
    thin = np.zeros((2, 28 * 210, 3), np.uint8)  # aspect ratio > 200
    items = [_image(0), str(bad), _image(1), thin, _image(2), _image(3), _image(4), _image(5)]
    got = list(encoder.encode_iter(items))
    assert [i for i, _ in got] == list(range(len(items)))
    failures = {i: v for i, v in got if isinstance(v, LoadFailure)}
    assert set(failures) == {1, 3}, f"failures at {sorted(failures)}"
    assert "broken.jpg" in failures[1].message and "aspect ratio" in failures[3].message
    want = encoder.encode([items[i] for i in (0, 2, 4, 5, 6, 7)])
    assert all(torch.equal(got[i][1], w) for i, w in zip((0, 2, 4, 5, 6, 7), want))


def test_encode_skips_an_extreme_aspect_ratio(encoder):
    thin = np.zeros((2, 28 * 210, 3), np.uint8)
    out = encoder.encode([_image(0), thin, _image(1)], errors="skip")
    assert out[1] is None and out[0] is not None and out[2] is not None
    with pytest.raises(ImageLoadError, match=r"1 of 3 images failed(.|\n)*\[1\] image #1: .*aspect ratio"):
        encoder.encode([_image(0), thin, _image(1)])


def test_encode_raise_stops_the_tower_after_a_failure(folder):
    enc = Encoder(folder, device="cpu", preprocess_workers=1, max_batch_patches=16)  # one image per chunk
    calls = []
    with enc.tower_call_hook(lambda run, pv, g: calls.append(g.shape[0]) or run(pv, g)), pytest.raises(ImageLoadError, match=r"2 of 6 images failed(.|\n)*\[2\](.|\n)*\[5\]"):
        enc.encode([_image(0), _image(1), np.zeros((0, 4, 3), np.uint8), _image(3), _image(4),
                    np.zeros((4, 0, 3), np.uint8)])
    # one image fills a chunk, so #0 and #1 leave as soon as they are ready; once #2's failure is seen no
    # tower call starts: #3 and #4 never reach the tower
    assert calls == [1, 1], f"tower calls (images each): {calls}; none should start once image #2 has failed"
    enc.close()


class _Calls(list):
    """Images per tower call of an Encoder from now on (its tower_call_hook stays entered while this lives)."""


def _spy_calls(enc) -> list:
    calls = _Calls()
    calls.hook = enc.tower_call_hook(lambda run, pv, g: calls.append(g.shape[0]) or run(pv, g))
    calls.hook.__enter__()
    return calls


def test_first_tower_call_is_small_and_results_do_not_change(folder, tmp_path):
    """encode/encode_iter: the first tower call takes at most first_chunk_patches (so it starts while
    the rest is decoded), later calls grow by chunk_growth (math.inf: straight to max_batch_patches);
    order, per-image failures and results (fp tolerance) as with one call."""
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"not a jpeg")
    images = [_image(i, 56, 28 * (1 + i % 3)) for i in range(7)]
    items = images[:2] + [str(bad)] + images[2:]
    with Encoder(folder, device="cpu", preprocess_workers=2, max_batch_patches=4096) as one, \
            Encoder(folder, device="cpu", preprocess_workers=2, max_batch_patches=4096, first_chunk_patches=10) as lead, \
            Encoder(folder, device="cpu", preprocess_workers=2, max_batch_patches=4096, first_chunk_patches=10,
                    chunk_growth=math.inf) as jump:
        assert one.first_chunk_patches == 256 and lead.first_chunk_patches == 10
        calls_one, calls_lead, calls_jump = _spy_calls(one), _spy_calls(lead), _spy_calls(jump)
        want = one.encode(items, errors="skip")
        got = lead.encode(items, errors="skip")
        jumped = jump.encode(items, errors="skip")
        rows = [int(g.prod()) for g in one.preprocess(images)[1]]  # 24, 16, 24, 24, 16, 24, 24 patches
        # 24 | 16 + 24 | 24 + 16 + 24 + 24: limits 10, 48, 96 (each twice the larger of the last limit and rows)
        assert calls_one == [7] and calls_lead == [1, 2, 4] and calls_jump == [1, 6], (
            f"tower calls (images): {calls_one}, {calls_lead}, {calls_jump}")
        assert lead.chunk_schedule.split(rows) == calls_lead, rows
        assert got[2] is None and want[2] is None
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None:
                for other in (g, jumped[i]):
                    err = float((other - w).norm() / w.norm())
                    assert err < 1e-5, f"image {i}: the chunk split changes it by {err:.2e} (tolerance 1e-5)"
        streamed = list(lead.encode_iter(items))
        assert [i for i, _ in streamed] == list(range(len(items))) and isinstance(streamed[2][1], LoadFailure)
        assert all(torch.equal(v, got[i]) for i, v in streamed if i != 2)
        assert calls_lead[3:] == [1, 2, 4], f"encode_iter's tower calls (images): {calls_lead[3:]}"
    with pytest.raises(ValueError, match="first_chunk_patches=0 must be an int >= 1"):
        Encoder(folder, device="cpu", first_chunk_patches=0)
    with pytest.raises(ValueError, match=r"chunk_growth=0.5 must be a number >= 1"):
        Encoder(folder, device="cpu", chunk_growth=0.5)
    with pytest.raises(ValueError, match=r"ChunkSchedule.growth=nan must be a number >= 1"):
        lead.chunk_schedule.__class__(64, 8, float("nan"))


def test_repeated_calls_repeat_their_packings(folder):
    """The schedule depends on sizes only: the same images twice give the same tower calls (grids), so a
    CUDA graph per packing replays; the workers' timing (0, 1 or 2 threads) changes nothing."""
    images = [_image(i, 28 * (1 + i % 4), 28 * (1 + (i * 3) % 4)) for i in range(13)]
    grids = []
    for workers in (0, 1, 2, 2):
        with Encoder(folder, device="cpu", preprocess_workers=workers, max_batch_patches=96,
                     first_chunk_patches=8) as enc:
            seen = []
            with enc.tower_call_hook(lambda run, pv, g: seen.append(g.tolist()) or run(pv, g)):
                enc.encode(images)
            grids.append(seen)
            rows = [t * h * w for g in seen for t, h, w in g]
            assert [len(g) for g in seen] == enc.chunk_schedule.split(rows)
            assert all(sum(t * h * w for t, h, w in g) <= 96 or len(g) == 1 for g in seen)
            assert sum(t * h * w for t, h, w in seen[0]) <= 8 or len(seen[0]) == 1
    assert all(g == grids[0] for g in grids), f"packings differ between identical calls: {grids}"
    assert len(grids[0]) >= 3, f"expected a growing schedule over several calls, got {grids[0]}"


def test_first_chunk_split_is_bitwise_under_batch_invariant(folder):
    images = [_image(i, 56, 28 * (1 + i % 3)) for i in range(5)]
    with Encoder(folder, device="cpu", preprocess_workers=2, batch_invariant=True) as one, \
            Encoder(folder, device="cpu", preprocess_workers=2, batch_invariant=True, first_chunk_patches=1) as lead:
        calls = _spy_calls(lead)
        want, got = one.encode(images), lead.encode(images)
    assert calls == [1, 2, 2]  # 24 | 16 + 24 (limit 48) | 24 + 16
    assert all(torch.equal(g, w) for g, w in zip(got, want)), "batch_invariant: the chunk split changed bits"


def test_other_threads_interleave_between_stream_chunks(encoder):
    import threading

    images = [_image(i) for i in range(12)]
    want = encoder.encode(images)
    results, errors = {}, []

    def work(k):
        try:
            results[k] = [emb for _, emb in encoder.encode_iter(images[k:] + images[:k])]
        except BaseException as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    assert not errors and len(results) == 3, errors
    for k, got in results.items():
        for j, emb in enumerate(got):
            ref = want[(j + k) % 12]
            err = float((emb - ref).norm() / ref.norm())
            assert err < 1e-5, f"thread {k}, image {j}: differs from its sequential result by {err:.2e} (crossed?)"


def test_e2e_bench_runs_on_cpu(folder, tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert main(["bench", "--model", folder, "--e2e", "--grid", "1x8x8*2", "--warmup", "0", "--iters", "1",
                 "--stream-images", "6", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("mmenc encode(files)", "mmenc tower only", "transformers proc+tower", "stream: 6 images",
                   "GPU busy", "invariance (an image of grid 1x8x8 alone", "1x8x8*2 encode trace: wall",
                   "stream trace: wall", "stream trace host ms: chunk_wait", "tower alone over the same packings"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    data = json.loads(out.read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {"mmenc encode(files)", "mmenc encode(files) 1 call", "mmenc encode(files) first+rest",
                     "mmenc preprocess only", "mmenc tower only", "transformers proc+tower",
                     "transformers proc only"}  # eager rows only with compile/graphs
    assert all(r["ms"] > 0 and r["images"] == 2 for r in data["rows"])
    (summary,) = data["workloads"]
    assert summary["grids_equal_transformers"] is True
    assert summary["pixels_max_diff_vs_transformers"] < 0.1, summary  # a few uint8 levels at most
    assert 0 < summary["preprocess_share"]
    stream = data["stream"]
    assert stream["images"] == 6 and stream["failed"] == 0 and 0 < stream["gpu_busy_fraction"] <= 1.0
    trace = stream["trace"]
    assert sum(c["images"] for c in trace["calls"]) == 6 and trace["tower_calls"] == len(trace["calls"]) >= 1
    assert {"chunk_wait_s", "launch_s", "worker_wait_s", "stage_s"} <= set(trace["host_s"]), trace["host_s"]
    assert stream["tower_same_packings_s"] > 0 and stream["vs_tower_same_packings"] > 0
    assert sum(c["images"] for c in summary["encode_trace"]["calls"]) == 2
    assert data["chunk_growth"] == 2.0 and data["chunks_in_flight"] == 2
    assert data["worker_kind"] == "thread"  # auto on a CPU device
    inv = data["invariance"]
    assert len(inv["max_abs_diff"]) == 4 and inv["max_abs_diff_overall"] < 1e-3 * max(inv["max_abs_value"], 1)


def test_tower_trace_splits_the_wall_time_of_a_call(folder):
    """TowerTrace (the bench's instrument): one record per tower call in order, a gap between each two,
    lead-in and tail, host seconds of this call only, and the tower alone over the same packings."""
    from mmenc.bench.trace import TowerTrace, format_trace, tower_only_ms

    images = [_image(i, 56, 28 * (1 + i % 3)) for i in range(9)]
    with Encoder(folder, device="cpu", preprocess_workers=2, max_batch_patches=64, first_chunk_patches=8) as enc:
        enc.encode(images)  # earlier work: must not count in the trace below
        with TowerTrace(enc) as trace:
            enc.encode(images)
        enc.encode(images)  # later work: must not count either
        report = trace.report()
        assert [len(g) for g in trace.grids()] == enc.chunk_schedule.split(
            [int(g.prod()) for g in enc.preprocess(images)[1]])
        same_ms = tower_only_ms(enc, trace.grids(), enc.loaded.config.patch_features)
    calls = report["calls"]
    assert len(calls) >= 3 and sum(c["images"] for c in calls) == 9 and calls[0]["gap_before_ms"] is None
    assert all(c["gap_before_ms"] >= 0 for c in calls[1:]) and all(c["graph"] == "-" for c in calls)
    assert report["gaps_ms_sum"] == pytest.approx(sum(c["gap_before_ms"] for c in calls[1:]))
    parts = report["lead_in_ms"] + report["tower_ms"] + report["gaps_ms_sum"] + report["tail_ms"]
    assert parts <= report["wall_ms"] + 1e-6 and 0 < report["busy_fraction"] <= 1
    assert report["host_s"]["chunk_wait_s"] <= report["wall_ms"] / 1e3, report["host_s"]
    assert same_ms > 0
    assert "tower calls" in format_trace("t", report) and "t host ms: " in format_trace("t", report)


def test_e2e_eager_rows_and_their_tower_comparison(encoder, tmp_path, monkeypatch):
    from mmenc.bench import e2e

    paths = e2e.write_jpegs(tmp_path, [(56, 56), (112, 56)])
    sentinel = object()
    monkeypatch.setattr(encoder.loaded, "graphs", sentinel)  # would fail if called: the eager rows must not
    pixel_values, grid = encoder.preprocess([_image(0)])
    with e2e.eager(encoder):
        encoder.encode_pixels(pixel_values, grid)
    assert encoder.loaded.graphs is sentinel and encoder.first_chunk_patches == 4
    with e2e.one_call(encoder):
        assert encoder.first_chunk_patches == encoder.max_batch_patches
    assert encoder.first_chunk_patches == 4
    monkeypatch.setattr(encoder.loaded, "graphs", None)
    assert not e2e.has_eager_rows(encoder)  # neither compile nor graphs: no eager rows
    monkeypatch.setattr(e2e, "has_eager_rows", lambda enc: True)
    rows, _ = e2e.run_workload("w", encoder, paths, None, None, warmup=0, iters=1)
    assert [r.impl for r in rows] == ["mmenc encode(files)", "mmenc encode(files) 1 call",
                                      "mmenc encode(files) first+rest", "mmenc preprocess only", "mmenc tower only",
                                      "mmenc encode(files) eager", "mmenc tower only eager"]
    table = e2e.format_rows([e2e.E2ERow("w", "mmenc encode(files)", 2, 20.0),
                             e2e.E2ERow("w", "mmenc tower only", 2, 19.0),
                             e2e.E2ERow("w", "mmenc encode(files) eager", 2, 50.0),
                             e2e.E2ERow("w", "mmenc tower only eager", 2, 40.0)]).splitlines()
    assert table[2].endswith("95%") and table[4].endswith("80%"), "\n".join(table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stream_on_cuda_matches_encode_and_stays_on_the_device(folder):
    images = [_image(i, 28 * (1 + i % 3), 56) for i in range(10)]
    with Encoder(folder, device="cuda", dtype="float32", max_batch_patches=64) as enc:
        got = list(enc.encode_iter(images))
        want = enc.encode(images)
        cpu = Encoder(folder, device="cpu").encode(images)
    assert [i for i, _ in got] == list(range(10))
    for (i, emb), ref, host in zip(got, want, cpu):
        assert emb.device.type == "cuda" and torch.equal(emb, ref), f"image {i}: stream differs from encode"
        err = float((emb.cpu() - host).norm() / host.norm())
        assert err < 5e-3, f"image {i}: CUDA differs from CPU by {err:.2e} (tolerance 5e-3, TF32 matmuls)"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_repeated_encode_on_cuda_replays_its_graphs(folder):
    """The growing schedule gives the same packings on every call, so the second call captures each and
    the third replays them all; results agree with the first (eager) call."""
    images = [_image(i, 28 * (1 + i % 3), 56) for i in range(10)]
    with Encoder(folder, device="cuda", dtype="float32", cuda_graphs=True, max_batch_patches=64,
                 first_chunk_patches=8) as enc:
        first = enc.encode(images)
        keys = len({tuple(map(tuple, g)) for g in _grids_of(enc, images)})
        enc.encode(images)
        before = enc.graph_stats()
        third = enc.encode(images)
        stats = enc.graph_stats()
    calls = len(_grids_of(enc, images))
    assert stats["captures"] == keys and stats["replays"] - before.get("replays", 0) == calls, dict(stats)
    for i, (a, b) in enumerate(zip(first, third)):
        err = float((a - b).norm() / a.norm())
        assert err < 1e-4, f"image {i}: a replay differs from the eager call by {err:.2e} (tolerance 1e-4)"


def _grids_of(enc, images) -> list:
    """The packings (grid lists) of one encode of `images` under enc's chunk schedule."""
    grid = enc.preprocess(images)[1].tolist()
    out, start = [], 0
    for n in enc.chunk_schedule.split([t * h * w for t, h, w in grid]):
        out.append(grid[start:start + n])
        start += n
    return out


def test_e2e_bench_on_fixed_frames_and_a_mismatched_processor(tmp_path, capsys):
    """Gemma 3's tower takes only its trained 4x4-patch frames: the invariance probe falls back to the grids its
    files gave instead of failing the run. A Qwen3-VL folder without preprocessor_config.json: transformers'
    processor class defaults to other pixel bounds than mmenc's Qwen3-VL preset, so its rows are left out with
    both shapes (they crashed the run before), and the patch size it is given is the tower's."""
    from mmenc.testing import checkpoints as ck

    gemma, _ = ck.FAMILIES["Gemma3ForConditionalGeneration"].save(tmp_path / "gemma")
    out = tmp_path / "gemma.json"
    assert main(["bench", "--model", str(gemma), "--e2e", "--grid", "1x4x4*2", "--warmup", "0", "--iters", "1",
                 "--stream-images", "0", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    assert "invariance probe on the files' grids [1, 4, 4] and [1, 4, 4]" in captured.err
    inv = json.loads(out.read_text())["invariance"]
    assert inv["small_grid"] == [1, 4, 4] and len(inv["max_abs_diff"]) == 4
    qwen3, _ = ck.FAMILIES["Qwen3VLForConditionalGeneration"].save(tmp_path / "qwen3")
    out = tmp_path / "qwen3.json"
    assert main(["bench", "--model", str(qwen3), "--e2e", "--grid", "1x4x4*2", "--warmup", "0", "--iters", "1",
                 "--stream-images", "0", "--json", str(out)]) == 0
    (summary,) = json.loads(out.read_text())["workloads"]
    assert summary["grids_equal_transformers"] is False
    assert "transformers' processor gives pixel_values (32, 1536)" in summary["transformers_skipped"]  # patch 16


@pytest.mark.parametrize("key", ["CLIPModel", "SiglipModel", "Siglip2Model", "PaliGemmaForConditionalGeneration",
                                 "LlavaForConditionalGeneration", "InternVLForConditionalGeneration"])
def test_e2e_transformers_rows_on_its_processor_output(key, tmp_path):
    """--e2e for towers whose transformers processor answers no grid (whole images, NaFlex batches, Pixtral's
    padded batch, InternVL's tiles): the reference runs on that output (`from_processor`), and both sides yield
    the same embedding rows for the files; for whole images, the same values on transformers' pixels."""
    from mmenc import Encoder
    from mmenc.bench import e2e
    from mmenc.bench.hf_reference import build_hf_tower
    from mmenc.testing import checkpoints as ck

    folder, _ = ck.FAMILIES[key].save(tmp_path / "ckpt")
    paths = e2e.write_jpegs(tmp_path / "jpegs", [(64, 64), (80, 48)])
    with Encoder(str(folder), device="cpu") as enc:
        hf = build_hf_tower(enc.loaded)
        hf_proc = e2e.hf_image_processor(enc.loaded.hf_config["model_type"], enc.loaded.processor_settings,
                                         tmp_path / "hf")
        rows, summary = e2e.run_workload("w", enc, paths, hf_proc, hf, warmup=0, iters=1)
        assert summary.get("tokens_equal_transformers") is True, summary.get("transformers_skipped")
        assert "transformers proc+tower" in [r.impl for r in rows]
        from PIL import Image

        out = hf_proc(images=[Image.open(p).convert("RGB") for p in paths], return_tensors="pt")
        if out["pixel_values"].dim() == 4 and "image_sizes" not in out and key != "InternVLForConditionalGeneration":
            p = enc.loaded.config.patch_size
            n, c, h, w = out["pixel_values"].shape
            grid = torch.tensor([[1, h // p, w // p]] * n)
            rows_in = out["pixel_values"].reshape(n, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
            want = enc.encode_pixels(rows_in.reshape(n * (h // p) * (w // p), -1), grid)
            torch.testing.assert_close(hf.from_processor(out), want, rtol=1e-5, atol=1e-5)
