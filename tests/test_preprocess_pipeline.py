"""Parallel per-image preprocessing (mmenc.preprocess.pipeline): bitwise the sequential processor,
input order, per-image failures, chunking with bounded look-ahead; the exact uint8 resize; GPU paths."""
import importlib.util
import io
import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from mmenc.preprocess import ImageLoadError, get_processor
from mmenc.preprocess import gpu_decode
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.placement import default_workers
from mmenc.preprocess.staging import pinned_copy as _pinned
from mmenc.preprocess.plan import ImagePreprocessError
from mmenc.preprocess.resize_exact import axis_weights, band_to_dense, resize_uint8_exact, tap_columns

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
needs_tv = pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="needs torchvision")

FAMILIES = [("qwen2_vl", {}, {}), ("qwen3_vl", {}, {}), ("glm4v", {}, {}), ("kimi_k25", {}, {}),
            ("qwen2_vl", {}, {"backend": "pil"}),
            ("kimi_k25", {"max_patches": 300, "size": {"max_height": 20, "max_width": 20}}, {})]
FAMILY_IDS = ["qwen2_vl", "qwen3_vl", "glm4v", "kimi_k25", "qwen2_vl-pil", "kimi_k25-small"]


def _jpeg(a: np.ndarray, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _smooth(rng, h: int, w: int) -> np.ndarray:
    """Photo-like: bicubic-upscaled noise plus a little grain."""
    coarse = rng.integers(0, 256, (h // 16 + 2, w // 16 + 2, 3), dtype=np.uint8)
    a = np.asarray(Image.fromarray(coarse).resize((w, h), Image.Resampling.BICUBIC)).astype(np.int16)
    return np.clip(a + rng.integers(-6, 7, a.shape), 0, 255).astype(np.uint8)


def _inputs(tmp_path):
    """Mixed inputs: PIL, numpy, PNG path, JPEG bytes, sizes needing up/down-scaling, a repeated size."""
    rng = np.random.default_rng(0)
    sizes = [(33, 97), (97, 33), (224, 224), (500, 301), (1, 1), (28, 28), (12, 700), (640, 480)]
    ims = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    ims[2].save(tmp_path / "c.png")
    return ims + [tmp_path / "c.png", _jpeg(_smooth(rng, 300, 200)), np.asarray(ims[0]), ims[3]]


# -- the exact resize ----------------------------------------------------------------------------
RESIZES = [((1036, 1036), (448, 448)), ((333, 517), (812, 812)), ((97, 33), (28, 56)), ((1, 1), (28, 28)),
           ((12, 700), (28, 1400)), ((500, 301), (500, 280)), ((300, 300), (301, 299)), ((2000, 1500), (100, 75))]


@pytest.mark.parametrize("src,dst", RESIZES, ids=[f"{s[0]}x{s[1]}-{d[0]}x{d[1]}" for s, d in RESIZES])
def test_exact_resize_is_torch_cpu_uint8_kernel(src, dst):
    x = torch.randint(0, 256, (2, 3, *src), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = F.interpolate(x, size=dst, mode="bicubic", antialias=True, align_corners=False)
    out = resize_uint8_exact(x, *dst)
    assert out.dtype == torch.uint8 and out.shape == ref.shape
    assert torch.equal(out, ref), f"max diff {(out.int() - ref.int()).abs().max().item()} levels, expected 0"


def test_exact_resize_weights_over_many_sizes():
    """The vectorized band weights against torch's CPU kernel over random size pairs (up- and downscaling,
    1 px, 20x), and the band as the device builds it (scatter of clamped taps) equal to the dense matrix."""
    rng = np.random.default_rng(3)
    pairs = [tuple(int(v) for v in rng.integers(1, 700, 2)) for _ in range(30)] + [(1, 7), (7, 1), (900, 45)]
    for n_in, n_out in pairs:
        x = torch.from_numpy(rng.integers(0, 256, (1, 3, 5, n_in), dtype=np.uint8))
        ref = F.interpolate(x, size=(5, n_out), mode="bicubic", antialias=True, align_corners=False)
        assert torch.equal(resize_uint8_exact(x, 5, n_out), ref), (n_in, n_out)
        cols, fixed, _ = tap_columns(n_in, n_out)
        dense = band_to_dense(torch.from_numpy(cols), torch.from_numpy(fixed), n_in)
        assert torch.equal(dense, torch.from_numpy(axis_weights(n_in, n_out)[0])), (n_in, n_out)


def test_exact_resize_needs_uint8():
    with pytest.raises(ValueError, match="needs uint8 images, got torch.float32"):
        resize_uint8_exact(torch.zeros(3, 4, 4), 2, 2)


# -- bitwise the sequential processor ----------------------------------------------------------------
@pytest.mark.parametrize("kind,cfg,overrides", FAMILIES, ids=FAMILY_IDS)
def test_pipeline_bitwise_equals_sequential(tmp_path, kind, cfg, overrides):
    ims = _inputs(tmp_path)
    proc = get_processor(kind, cfg, **overrides)
    ref_pv, ref_grid = proc(ims)
    for workers in (0, 1, 2):
        for resize in ("cpu", "device"):  # "device" is the CPU here: same code path as on a GPU but the kernel
            with Preprocessor(proc, workers=workers, resize=resize) as pre:
                pv, grid, failures = pre.run(ims)
            assert failures == [] and torch.equal(grid, ref_grid)
            assert pv.dtype == torch.float32 and pv.shape == ref_pv.shape
            assert torch.equal(pv, ref_pv), f"workers={workers} resize={resize}: max diff {(pv - ref_pv).abs().max()}"


def test_exact_resize_of_a_channels_last_view_is_the_same():
    """On a GPU the images arrive as [C, H, W] views of their decoded [H, W, C] memory (no transpose)."""
    hwc = torch.randint(0, 256, (97, 133, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    view = hwc.permute(2, 0, 1)
    assert not view.is_contiguous()
    for size in [(50, 60), (97, 133), (200, 90)]:
        assert torch.equal(resize_uint8_exact(view, *size), resize_uint8_exact(view.contiguous(), *size))


@pytest.mark.parametrize("kind,cfg,overrides", FAMILIES, ids=FAMILY_IDS)
def test_processors_do_not_depend_on_the_memory_layout(kind, cfg, overrides):
    """resize_one + finish of a [C, H, W] view of [H, W, C] memory == of the contiguous image, bitwise."""
    proc = get_processor(kind, cfg, **overrides)
    rng = np.random.default_rng(5)
    hwcs = [torch.from_numpy(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(61, 90), (56, 56)]]
    plans = [proc.plan(t.shape[0], t.shape[1]) for t in hwcs]
    views = [t.permute(2, 0, 1) for t in hwcs]
    got = proc.finish([proc.resize_one(v, p) for v, p in zip(views, plans)], plans)
    want = proc.finish([proc.resize_one(v.contiguous(), p) for v, p in zip(views, plans)], plans)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_pinned_copy_keeps_values_and_layout():
    hwc = np.random.default_rng(6).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    hwc.setflags(write=False)  # as PIL's arrays are
    from_numpy = _pinned(hwc)
    assert from_numpy.shape == (3, 20, 30) and from_numpy.permute(1, 2, 0).is_contiguous()
    assert torch.equal(from_numpy, torch.from_numpy(hwc.copy()).permute(2, 0, 1))
    view = torch.from_numpy(hwc.copy()).permute(2, 0, 1)
    for src in (view, view.contiguous(), view[:, ::2]):  # channels-last view, CHW, a strided slice
        assert torch.equal(_pinned(src), src)
    assert _pinned(view).stride() == view.stride()  # [H, W, C] memory stays so: no transpose
    assert _pinned(view.contiguous()).is_contiguous() and _pinned(view[:, ::2]).is_contiguous()
    if torch.cuda.is_available():
        assert _pinned(view).is_pinned()


def test_decode_choice():
    reason = gpu_decode.cpu_decoder_reason()
    with Preprocessor(get_processor("qwen2_vl"), workers=0) as pre:
        assert pre.decode == ("cpu" if reason else "torchvision")
    assert Preprocessor(get_processor("qwen2_vl"), workers=0, decode="cpu").decode == "cpu"
    if reason:
        with pytest.raises(ValueError, match="decode='torchvision' cannot run: .*use decode='cpu'"):
            Preprocessor(get_processor("qwen2_vl"), decode="torchvision")
    with pytest.raises(ValueError, match="expected 'auto', 'cpu', 'torchvision' or 'gpu'"):
        Preprocessor(get_processor("qwen2_vl"), decode="nvjpeg")


@needs_tv
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, needs_cuda])])
def test_torchvision_decode_equals_pil(tmp_path, device):
    """decode="torchvision" (libjpeg-turbo without the GIL) gives PIL's pixels; what it does not take
    (PNG, truncated JPEG, EXIF rotation, arrays) goes through load_image with its errors."""
    if gpu_decode.cpu_decoder_reason():
        pytest.skip(gpu_decode.cpu_decoder_reason())
    rng = np.random.default_rng(7)
    datas = [_jpeg(_smooth(rng, h, w)) for h, w in [(1036, 1036), (448, 448), (300, 517), (97, 33)]]
    path = tmp_path / "a.jpg"
    path.write_bytes(datas[2])
    items = datas + [str(path), datas[0][:len(datas[0]) // 2]] + _inputs(tmp_path)
    proc = get_processor("qwen2_vl")
    with Preprocessor(proc, device=device, workers=4, decode="torchvision") as tv, \
            Preprocessor(proc, device=device, workers=4, decode="cpu") as pil:
        got, want = tv.run(items, errors="skip"), pil.run(items, errors="skip")
    assert [f.index for f in got.failures] == [5] and "truncated" in got.failures[0].message
    assert torch.equal(got.grid_thw, want.grid_thw)
    levels = float((got.pixel_values - want.pixel_values).abs().max()) * 255 * max(proc.config.image_std)
    print(f"torchvision vs PIL decode, after preprocessing on {device}: max {levels:.3f} uint8 levels")
    assert levels <= 1.0 + 1e-4


def test_per_image_resize_equals_batched():
    """The sequential processor resizes same-size images in one call; per image gives the same bytes."""
    x = torch.randint(0, 256, (5, 3, 333, 517), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    batched = F.interpolate(x, size=(812, 812), mode="bicubic", antialias=True)
    for i in range(5):
        assert torch.equal(F.interpolate(x[i:i + 1], size=(812, 812), mode="bicubic", antialias=True)[0], batched[i])


def test_workers_run_in_threads_and_keep_input_order():
    proc = get_processor("qwen2_vl")
    threads = set()
    plan = proc.plan

    def spy(*a, **kw):
        threads.add(threading.current_thread().name)
        return plan(*a, **kw)

    proc.plan = spy
    sizes = [56 * (1 + i % 5) for i in range(20)]
    ims = [np.full((s, 56, 3), i, np.uint8) for i, s in enumerate(sizes)]
    with Preprocessor(proc, workers=3) as pre:
        pv, grid, _ = pre.run(ims)
    assert all(t.startswith("mmenc-preprocess") for t in threads), threads
    assert grid[:, 1].tolist() == [s // 14 for s in sizes]  # input order
    ref, _ = get_processor("qwen2_vl")(ims)
    assert torch.equal(pv, ref)
    assert default_workers() >= 1


# -- per-image failures --------------------------------------------------------------------------------
def _mixed(tmp_path):
    rng = np.random.default_rng(2)
    good = [rng.integers(0, 256, (56 * k, 56, 3), dtype=np.uint8) for k in range(1, 5)]
    data = _jpeg(good[1])
    thin = tmp_path / "thin.png"
    Image.fromarray(np.zeros((2, 500, 3), np.uint8)).save(thin)
    big = tmp_path / "big.png"
    Image.fromarray(np.zeros((300, 300, 3), np.uint8)).save(big)
    items = [good[0], thin, b"not an image", good[1], tmp_path / "missing.jpg", data[:len(data) // 3], good[2],
             big, good[3]]
    return items, {1: "aspect ratio must be at most 200", 2: "not an image", 4: "cannot read file",
                   5: "truncated", 7: "decompression bomb"}


def test_skip_reports_each_failure_and_encodes_the_rest(tmp_path):
    items, bad = _mixed(tmp_path)
    proc = get_processor("qwen2_vl")
    with Preprocessor(proc, workers=2, max_pixels=200 * 200) as pre:
        pv, grid, failures = pre.run(items, errors="skip")
    assert [f.index for f in failures] == sorted(bad)
    for f in failures:
        assert bad[f.index] in f.message and f.message.startswith(f.name), f
    assert failures[0].name == f"'{tmp_path / 'thin.png'}'"  # paths are named by their path
    ref, ref_grid = proc([items[i] for i in range(len(items)) if i not in bad])
    assert torch.equal(grid, ref_grid) and torch.equal(pv, ref)


def test_raise_lists_every_failure(tmp_path):
    items, bad = _mixed(tmp_path)
    with Preprocessor(get_processor("glm4v"), workers=2, max_pixels=200 * 200) as pre:
        with pytest.raises(ImageLoadError) as e:
            pre.run(items)
    msg = str(e.value)
    assert msg.startswith(f"{len(bad)} of {len(items)} images failed")
    for i, reason in bad.items():
        assert f"[{i}]" in msg and reason in msg


def test_plan_names_the_image():
    proc = get_processor("qwen2_vl")
    with pytest.raises(ImagePreprocessError, match=r"^'x.png': image width=300 height=1: aspect ratio") as e:
        proc.plan(1, 300, index=4, name="'x.png'")
    assert (e.value.index, e.value.name) == (4, "'x.png'") and e.value.failure().index == 4
    p = proc.plan(100, 50)
    assert p.resize == (112, 56) and p.grid == (1, 8, 4) and p.rows == 32
    with pytest.raises(ImagePreprocessError, match=r"image #2: size width=30 height=30 is not a multiple of patch_size\*merge"):
        get_processor("qwen2_vl", {"do_resize": False}).plan(30, 30, index=2)
    with pytest.raises(ImagePreprocessError, match="size width=30 height=30 is not a multiple of patch_size=14"):
        get_processor("kimi_k25", {"do_resize": False}).plan(30, 30)
    k = get_processor("kimi_k25").plan(30, 50)
    assert k.resize == (30, 50) and k.padded == (56, 56) and k.grid == (1, 4, 4) and k.rows == 16


def test_empty_and_all_failed():
    pre = Preprocessor(get_processor("qwen2_vl"), workers=0)
    pv, grid, failures = pre.run([])
    assert pv.shape == (0, 1176) and grid.shape == (0, 3) and failures == []
    pv, grid, failures = pre.run([b"x", b""], errors="skip")
    assert pv.shape == (0, 1176) and [f.index for f in failures] == [0, 1]
    pv, _, _ = Preprocessor(get_processor("kimi_k25"), workers=0).run([])
    assert pv.shape == (0, 3, 14, 14)


# -- streaming -----------------------------------------------------------------------------------------
def test_iter_chunks_whole_images_in_order(tmp_path):
    items, bad = _mixed(tmp_path)
    items = items + [np.zeros((560, 560, 3), np.uint8)]  # 1600 patches: alone in its chunk
    proc = get_processor("qwen2_vl")
    pre = Preprocessor(proc, workers=2, max_pixels=200 * 200)
    chunks = list(pre.iter_chunks(items, max_batch_patches=40, errors="skip"))
    pre.close()
    indices = [i for c in chunks for i in c.indices]
    assert indices == [i for i in range(len(items)) if i not in bad]
    assert sorted(f.index for c in chunks for f in c.failures) == sorted(bad)
    for c in chunks:
        rows = c.grid_thw.prod(-1)
        assert c.pixel_values.shape[0] == int(rows.sum()) and len(c.indices) == len(rows)
        assert rows.sum() <= 40 or len(rows) == 1
    assert chunks[-1].grid_thw.tolist() == [[1, 40, 40]]
    whole, _, _ = Preprocessor(proc, workers=0, max_pixels=200 * 200).run(items, errors="skip")
    assert torch.equal(torch.cat([c.pixel_values for c in chunks]), whole)


def test_iter_chunks_smaller_first_chunk(tmp_path):
    """first_chunk_patches: the first chunk holds at most that many rows (at least one image), the
    rest up to max_batch_patches; input order, failures and pixels as with one size of chunk."""
    items, bad = _mixed(tmp_path)  # good images of 16, 32, 48, 64 patches (56 px wide, 56..224 px high)
    items = [items[0], items[0]] + items  # + two 16-patch images first
    bad = {i + 2 for i in bad}
    proc = get_processor("qwen2_vl")
    with Preprocessor(proc, workers=2, max_pixels=200 * 200) as pre:
        chunks = list(pre.iter_chunks(items, max_batch_patches=40, first_chunk_patches=20, errors="skip"))
        one_image_first = list(pre.iter_chunks(items[2:], max_batch_patches=40, first_chunk_patches=1, errors="skip"))
        with pytest.raises(ValueError, match="first_chunk_patches=0 must be >= 1"):
            next(pre.iter_chunks(items, max_batch_patches=40, first_chunk_patches=0))
    rows = [c.grid_thw.prod(-1).tolist() for c in chunks]
    assert rows == [[16], [16, 16], [32], [48], [64]], f"rows per chunk {rows}: expected the first limited to 20"
    assert [i for c in chunks for i in c.indices] == [i for i in range(len(items)) if i not in bad]
    assert sorted(f.index for c in chunks for f in c.failures) == sorted(bad)
    assert one_image_first[0].indices == [0] and len(one_image_first[0].grid_thw) == 1
    whole, _, _ = Preprocessor(proc, workers=0, max_pixels=200 * 200).run(items, errors="skip")
    assert torch.equal(torch.cat([c.pixel_values for c in chunks]), whole)


def test_iter_chunks_raise_stops_at_first_failure(tmp_path):
    items, _ = _mixed(tmp_path)
    seen = []
    with Preprocessor(get_processor("qwen2_vl"), workers=2) as pre:
        with pytest.raises(ImagePreprocessError, match="aspect ratio") as e:
            for chunk in pre.iter_chunks(items, max_batch_patches=16):
                seen += chunk.indices
    assert seen == [0] and (e.value.index, e.value.name) == (1, f"'{items[1]}'")


def test_iter_chunks_looks_ahead_a_bounded_amount():
    taken = []

    def images():
        for i in range(400):
            taken.append(i)
            yield np.zeros((56, 56, 3), np.uint8)  # 16 patches each

    with Preprocessor(get_processor("qwen2_vl"), workers=2, prefetch_chunks=2) as pre:
        it = pre.iter_chunks(images(), max_batch_patches=64)  # 4 images per chunk
        first = next(it)
        assert first.indices == [0, 1, 2, 3]
        assert len(taken) <= 4 + 1 + 2 * 4 + 4, f"{len(taken)} images pulled for the first chunk"
        assert sum(len(c.indices) for c in it) == 396


def test_settings_are_checked():
    proc = get_processor("qwen2_vl")
    with pytest.raises(ValueError, match="workers=-1 must be >= 0"):
        Preprocessor(proc, workers=-1)
    with pytest.raises(ValueError, match="decode='gpu' cannot run: device=cpu is not a CUDA device"):
        Preprocessor(proc, decode="gpu")
    with pytest.raises(ValueError, match="resize='gpu'; expected 'auto', 'cpu', 'device' or 'split'"):
        Preprocessor(proc, resize="gpu")
    with pytest.raises(ValueError, match="prefetch_chunks=0"):
        Preprocessor(proc, prefetch_chunks=0)
    with pytest.raises(TypeError, match="has no plan"):
        Preprocessor(object())
    pre = Preprocessor(proc, workers=0)
    assert (pre.resize, pre.decode) == ("cpu", "cpu")
    with pytest.raises(ValueError, match="errors='ignore' not supported"):
        pre.run([], errors="ignore")
    with pytest.raises(ValueError, match="max_batch_patches=0 must be >= 1"):
        next(pre.iter_chunks([], max_batch_patches=0))


# -- GPU -------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("src,dst", RESIZES[:4], ids=[f"{s[0]}x{s[1]}-{d[0]}x{d[1]}" for s, d in RESIZES[:4]])
def test_exact_resize_on_cuda_is_the_cpu_kernel(src, dst):
    x = torch.randint(0, 256, (2, 3, *src), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    ref = F.interpolate(x, size=dst, mode="bicubic", antialias=True)
    assert torch.equal(resize_uint8_exact(x.cuda(), *dst).cpu(), ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kind,cfg,overrides", FAMILIES, ids=FAMILY_IDS)
def test_pipeline_on_cuda_bitwise_equals_cpu_sequential(tmp_path, kind, cfg, overrides):
    ims = _inputs(tmp_path)
    proc = get_processor(kind, cfg, **overrides)
    ref_pv, ref_grid = proc(ims)
    with Preprocessor(proc, device="cuda", workers=2, decode="cpu") as pre:  # PIL, as proc(); torchvision: below
        assert pre.resize == ("device" if overrides.get("backend", "torchvision") == "torchvision" else "cpu")
        pv, grid, _ = pre.run(ims)
    assert pv.device.type == "cuda" and torch.equal(grid, ref_grid)
    assert torch.equal(pv.cpu(), ref_pv), f"max diff {(pv.cpu() - ref_pv).abs().max()}"


@pytest.mark.gpu
@needs_cuda
@needs_tv
def test_gpu_jpeg_decode_close_to_cpu_decode():
    """nvJPEG vs libjpeg-turbo (decode="gpu" is opt-in for this reason): prints the difference after
    preprocessing, in uint8 levels scaled by the largest std (an upper bound); H200, run 9a: max 25, mean 2.21."""
    rng = np.random.default_rng(3)
    datas = [_jpeg(_smooth(rng, h, w)) for h, w in [(1036, 1036), (448, 448), (300, 517), (97, 33)]]
    proc = get_processor("qwen2_vl")
    ref_pv, ref_grid = proc(datas)
    with Preprocessor(proc, device="cuda", decode="gpu") as pre:
        pv, grid, _ = pre.run(datas)
    assert torch.equal(grid, ref_grid)
    levels = (pv.cpu() - ref_pv).abs() * 255 * max(proc.config.image_std)  # uint8 levels (upper bound)
    print(f"nvJPEG vs PIL decode, after preprocessing: max {levels.max().item():.2f} levels, "
          f"mean {levels.mean().item():.4f}")
    assert levels.mean() < 3


@pytest.mark.gpu
@needs_cuda
def test_staging_beside_a_busy_stream_is_safe():
    """Chunks staged on the Preprocessor's side stream while the current stream is busy (a chain of matmuls
    stands in for the tower) are read on the current stream without a host sync, and each chunk is dropped
    at once, so its memory could go to the next chunk's staging before the read ran (record_stream keeps
    it): every chunk equals the CPU processor's pixels, with the side stream and without it."""
    rng = np.random.default_rng(11)
    datas = [_jpeg(_smooth(rng, int(h), int(w))) for h, w in rng.integers(60, 700, (24, 2))]
    proc = get_processor("qwen2_vl")
    busy = torch.randn(2048, 2048, device="cuda")
    for beside in (True, False):
        with Preprocessor(proc, device="cuda", workers=2, decode="cpu") as pre:
            pre.stage_beside = beside
            copies = []
            for chunk in pre.iter_chunks(datas, max_batch_patches=3000):
                for _ in range(30):
                    busy = torch.tanh(busy @ busy * 1e-3)
                copies.append((chunk.indices, chunk.pixel_values.clone()))  # queued behind the matmuls
                del chunk
            assert (pre._stream is not None) == beside
        torch.cuda.synchronize()
        assert len(copies) > 3 and sorted(i for idx, _ in copies for i in idx) == list(range(len(datas)))
        for indices, pv in copies:
            ref_pv, _ = proc([datas[i] for i in indices])
            diff = (pv.cpu() - ref_pv).abs().max()
            assert torch.equal(pv.cpu(), ref_pv), f"beside={beside} chunk {indices}: max diff {diff}"


def test_step_spans_record_each_prepare_and_stage_while_open():
    """Preprocessor.step_spans: one "prepare" span per image, in the worker threads, and one "stage" span per
    chunk in the calling thread, each with its thread's CPU time; nothing is recorded once it is closed,
    and the run's output is the same as without it."""
    rng = np.random.default_rng(3)
    datas = [_jpeg(_smooth(rng, 56 + 28 * i, 84)) for i in range(3)]
    with Preprocessor(get_processor("qwen2_5_vl"), workers=2, worker_kind="thread") as pre:
        plain = pre.run(datas)
        with pre.step_spans() as spans:
            traced = pre.run(datas)
        pre.run(datas)
    assert torch.equal(plain[0], traced[0]) and torch.equal(plain[1], traced[1])
    prepares = [s for s in spans if s.step == "prepare"]
    stages = [s for s in spans if s.step == "stage"]
    assert len(prepares) == 3 and len(stages) == 1, spans
    assert all(s.thread.startswith("mmenc-preprocess") for s in prepares), prepares
    assert stages[0].thread == threading.current_thread().name
    assert all(s.end >= s.start and s.cpu_s >= 0 for s in spans)
    assert max(s.end for s in prepares) <= stages[0].end
