"""Preprocessor(worker_kind="process"): paths and bytes decoded in worker processes give bitwise the
thread mode's pixels, its order and its failure messages; early stops, errors and close() leave no
process and no shared segment behind; a dead worker fails the inputs it held; the Encoder in process
mode (and `mmenc encode --preprocess-worker-kind process`) gives the default's embeddings. (Each Preprocessor here starts its own processes: a few seconds.)"""
import io
import os
import signal
import time

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from mmenc.cli.main import main
from mmenc.engine.encoder import Encoder
from mmenc.preprocess import get_processor
from mmenc.preprocess.pipeline import Preprocessor
from mmenc.preprocess.placement import PROCESS_MIN_WORKERS
from mmenc.preprocess.plan import ImagePreprocessError
from mmenc.preprocess.prepare import ImageWork
from mmenc.preprocess.procs import ProcessWorkers
from mmenc.preprocess.staging import pinned_copy
from mmenc.testing.checkpoints import save_qwen2_5_vl


def _jpeg(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(a).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _mixed(folder):
    """Paths (JPEG, PNG), bytes, PIL, numpy, and inputs that fail: a file too thin to plan, bytes that are not
    an image, a missing file, a truncated JPEG, a decompression bomb (over max_pixels)."""
    rng = np.random.default_rng(3)
    items, bad = [], {}
    for k, (h, w) in enumerate([(56, 84), (130, 61), (200, 150), (33, 97)]):
        a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        path = folder / f"ok{k}.{'jpg' if k % 2 == 0 else 'png'}"
        Image.fromarray(a).save(path)
        items.append(path if k < 2 else str(path))
    data = _jpeg(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    Image.fromarray(np.zeros((2, 500, 3), np.uint8)).save(folder / "thin.png")
    Image.fromarray(np.zeros((300, 300, 3), np.uint8)).save(folder / "big.png")
    items += [data, Image.fromarray(rng.integers(0, 256, (40, 80, 3), dtype=np.uint8)),
              rng.integers(0, 256, (70, 70, 3), dtype=np.uint8), memoryview(data)]
    bad_items = {folder / "thin.png": "aspect ratio", b"not an image": "not an image",
                 folder / "missing.jpg": "cannot read file", data[:len(data) // 3]: "truncated",
                 folder / "big.png": "decompression bomb"}
    for j, (item, reason) in enumerate(bad_items.items()):
        items.insert(2 * j + 1, item)
        bad[2 * j + 1] = reason
    return items, bad


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _gone(pids: list[int], timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("kind,overrides", [("qwen2_vl", {}), ("kimi_k25", {}), ("qwen2_vl", {"backend": "pil"})],
                         ids=["qwen2_vl", "kimi_k25", "qwen2_vl-pil"])
def test_process_mode_bitwise_equals_thread_mode(tmp_path, kind, overrides):
    items, bad = _mixed(tmp_path)
    proc = get_processor(kind, **overrides)
    before = _shm()
    with Preprocessor(proc, workers=0, max_pixels=200 * 200) as pre:
        ref = pre.run(items, errors="skip")
    with Preprocessor(proc, workers=2, max_pixels=200 * 200, worker_kind="process") as pre:
        got = pre.run(items, errors="skip")
        chunks = list(pre.iter_chunks(items, max_batch_patches=64, errors="skip"))
        procs = pre._procs
        assert procs is not None and len(procs.pids) == 2, "paths and bytes went to worker processes"
        with pytest.raises(ImagePreprocessError) as e:  # errors="raise": the first failure, as in threads
            list(pre.iter_chunks(items, max_batch_patches=64))
        assert (e.value.index, str(e.value)) == (ref.failures[0].index, ref.failures[0].message)
        assert procs.lent == 0, f"{procs.lent} shared segments not given back"
    assert _gone(procs.pids), "worker processes still running after close()"
    assert got.failures == ref.failures  # same indices, names and messages
    thin_fails = kind != "kimi_k25"  # Kimi pads a 2x500 image instead of refusing it
    assert [f.index for f in got.failures] == sorted(i for i in bad if i != 1 or thin_fails)
    for f in got.failures:
        assert bad[f.index] in f.message, f
    assert torch.equal(got.grid_thw, ref.grid_thw) and torch.equal(got.pixel_values, ref.pixel_values)
    assert [i for c in chunks for i in c.indices] == [i for i in range(len(items)) if i not in
                                                      {f.index for f in ref.failures}]
    assert torch.equal(torch.cat([c.pixel_values for c in chunks]), ref.pixel_values)
    assert _shm() == before, "segments left in /dev/shm"


def test_pil_limit_of_the_parent_holds_in_the_workers(tmp_path, monkeypatch):
    """max_pixels=-1 follows PIL's Image.MAX_IMAGE_PIXELS of the calling process at call time
    (mmenc encode --max-image-pixels sets it), in the workers too."""
    path = tmp_path / "big.png"
    Image.fromarray(np.zeros((300, 300, 3), np.uint8)).save(path)
    proc = get_processor("qwen2_vl")
    with Preprocessor(proc, workers=3, worker_kind="process") as pre:
        assert pre.run([path], errors="skip").failures == []
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 200 * 200)
        failures = pre.run([path], errors="skip").failures
        assert len(pre._procs.pids) == 1, "one image at a time needs one worker process (they start as needed)"
    with Preprocessor(proc, workers=1, worker_kind="thread") as pre:
        assert pre.run([path], errors="skip").failures == failures
    assert len(failures) == 1 and "decompression bomb" in failures[0].message


def test_worker_keeps_the_decoded_layout_for_a_cuda_device(tmp_path):
    """For CUDA the decoded [H, W, C] memory crosses as it is ([C, H, W] view, no transpose); the
    staged pinned copy equals the thread mode's. ImageWork for a CUDA device runs here without CUDA
    (the workers make no CUDA call)."""
    rng = np.random.default_rng(5)
    a = rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)
    path = tmp_path / "a.png"
    Image.fromarray(a).save(path)
    work = ImageWork(get_processor("qwen2_vl"), decode="cpu", resize="device", device_type="cuda", max_pixels=-1)
    workers = ProcessWorkers(work, 1)
    try:
        ready = workers.submit(0, path).result(timeout=120)
        assert ready.pixels.shape == (3, 37, 53) and ready.pixels.stride() == (1, 53 * 3, 3)
        mine = work.prepare(0, path).pixels  # the thread mode: numpy [H, W, C]
        assert torch.equal(pinned_copy(ready.pixels), pinned_copy(mine))
        assert torch.equal(ready.pixels, torch.from_numpy(a).permute(2, 0, 1))
        ready.release()
        assert workers.lent == 0
    finally:
        workers.close()
    assert _gone(workers.pids)


def test_resize_per_image_crosses_to_the_worker_and_back(tmp_path):
    """resize="split" hands some images to the workers with resize="device" (left for the device) and the
    rest resized in the worker; Ready.resized says which, across the process boundary too."""
    rng = np.random.default_rng(6)
    path = tmp_path / "a.png"
    Image.fromarray(rng.integers(0, 256, (37, 53, 3), dtype=np.uint8)).save(path)
    proc = get_processor("qwen2_vl")
    work = ImageWork(proc, decode="cpu", resize="cpu", device_type="cuda", max_pixels=-1)
    plan = proc.plan(37, 53)
    workers = ProcessWorkers(work, 1)
    try:
        kept = workers.submit(0, path, "device").result(timeout=120)
        done = workers.submit(1, path).result(timeout=120)
        assert not kept.resized and kept.pixels.shape == (3, 37, 53)
        assert done.resized and done.pixels.shape == (3, *plan.resize)
        assert torch.equal(done.pixels, proc.resize_one(kept.pixels, plan))  # the device's resize, here on the CPU
        kept.release()
        done.release()
    finally:
        workers.close()
    assert _gone(workers.pids)
    assert not work.prepare(0, path, "device").resized and work.prepare(0, path).resized


def test_a_destroyed_segment_notice_does_not_block_the_other_workers(tmp_path):
    """A worker that destroys a released segment (its pool keeps none here; video pieces of tens of MB
    did it with the default) tells the parent to forget it. The one receiver thread read that notice
    and then blocked on that worker's socket for a next message that never came, so another worker's
    answer was never read: a batch of 16 copies of a 60 s clip sat idle on the H200 (issue 26)."""
    path = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (37, 53, 3), dtype=np.uint8)).save(path)
    work = ImageWork(get_processor("qwen2_vl"), decode="cpu", resize="device", device_type="cuda", max_pixels=-1)
    workers = ProcessWorkers(work, 2, keep_free_bytes=0)
    try:
        first, second = workers.submit(0, path), workers.submit(1, path)  # the second starts worker 2
        a, b = first.result(timeout=120), second.result(timeout=120)
        assert len(workers.pids) == 2
        b.release()  # worker 2 destroys the segment and sends its notice; worker 1 is idle
        time.sleep(0.5)
        third = workers.submit(2, path)  # the fewest in flight: worker 1 (all idle, the first)
        c = third.result(timeout=30)  # before the fix: TimeoutError, the receiver waiting on worker 2
        assert torch.equal(c.pixels, a.pixels)
        a.release()
        c.release()
        assert workers.lent == 0
    finally:
        workers.close()
    assert _gone(workers.pids)


def test_early_stop_and_errors_leave_nothing_behind(tmp_path):
    rng = np.random.default_rng(1)
    paths = []
    for k in range(6):
        paths.append(tmp_path / f"{k}.jpg")
        paths[-1].write_bytes(_jpeg(rng.integers(0, 256, (112, 112, 3), dtype=np.uint8)))
    stream = paths * 10  # 60 images of 64 patches
    before = _shm()
    pre = Preprocessor(get_processor("qwen2_vl"), workers=2, worker_kind="process")
    it = pre.iter_chunks(stream, max_batch_patches=128)
    assert next(it).indices == [0, 1]
    it.close()  # the consumer stops: what was prepared ahead is given back as it arrives
    procs = pre._procs
    deadline = time.monotonic() + 60
    while procs.lent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert procs.lent == 0, f"{procs.lent} shared segments still lent after the consumer stopped"
    with pytest.raises(KeyError, match="consumer failed"):  # an exception in the consumer
        for chunk in pre.iter_chunks(stream, max_batch_patches=128):
            raise KeyError("consumer failed")
    pids = procs.pids
    pre.close()
    assert _gone(pids), "worker processes still running after close()"
    assert _shm() == before
    out = pre.run(paths[:2])  # a closed Preprocessor starts new workers when used again
    assert out.grid_thw.tolist() == [[1, 8, 8]] * 2 and pre._procs is not procs
    pre.close()


def test_a_dead_worker_fails_the_inputs_it_held(tmp_path):
    path = tmp_path / "a.jpg"
    path.write_bytes(_jpeg(np.random.default_rng(0).integers(0, 256, (2000, 2000, 3), dtype=np.uint8)))
    work = ImageWork(get_processor("qwen2_vl"), decode="cpu", resize="cpu", device_type="cpu", max_pixels=-1)
    workers = ProcessWorkers(work, 1)
    try:
        workers.submit(0, path).result(timeout=120).release()  # up and working
        fut = workers.submit(7, path)
        os.kill(workers.pids[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match=r"worker process \d+ exited \(code -9\) while preparing input #7"):
            fut.result(timeout=60)
        with pytest.raises(RuntimeError, match="all 1 preprocessing worker processes have exited"):
            workers.submit(8, path)
    finally:
        workers.close()
    assert workers.lent == 0


def test_worker_kind_is_checked_and_auto_picks_processes_only_for_cuda_with_enough_workers():
    proc = get_processor("qwen2_vl")
    with pytest.raises(ValueError, match="worker_kind='fork'; expected 'auto', 'thread' or 'process'"):
        Preprocessor(proc, worker_kind="fork")
    with pytest.raises(ValueError, match="worker_kind='process' with workers=0"):
        Preprocessor(proc, workers=0, worker_kind="process")
    assert Preprocessor(proc, workers=8).worker_kind == "thread"  # a CPU device: the caller launches nothing
    # Choosing starts nothing (processes start on first use), so a CUDA device needs no GPU here.
    few, many = PROCESS_MIN_WORKERS - 1, PROCESS_MIN_WORKERS
    assert Preprocessor(proc, device="cuda", workers=few).worker_kind == "thread"
    assert Preprocessor(proc, device="cuda", workers=many).worker_kind == "process"
    assert Preprocessor(proc, device="cuda", workers=many, worker_kind="thread").worker_kind == "thread"
    # resize="auto" on CUDA: "split" with worker processes (a call's first images on the GPU, the rest in the
    # workers), on the GPU with threads; "split" needs a GPU and the torchvision backend
    assert Preprocessor(proc, device="cuda", workers=many).resize == "split"
    assert Preprocessor(proc, device="cuda", workers=few).resize == "device"
    assert Preprocessor(proc, device="cuda", workers=many, resize="device").resize == "device"
    with pytest.raises(ValueError, match="resize='split' needs a GPU device"):
        Preprocessor(proc, resize="split")


def test_encoder_in_process_mode_equals_default(tmp_path):
    folder = str(save_qwen2_5_vl(tmp_path / "ckpt")[0])
    rng = np.random.default_rng(4)
    items = []
    for k, (h, w) in enumerate([(56, 84), (112, 56), (60, 61), (90, 140)]):
        path = tmp_path / f"{k}.jpg"
        path.write_bytes(_jpeg(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
        items.append(path if k % 2 else path.read_bytes())
    items.insert(2, b"broken")
    with Encoder(folder, device="cpu") as default:
        ref = default.encode(items, errors="skip")
        ref_iter = list(default.encode_iter(items))
    with Encoder(folder, device="cpu", preprocess_workers=2, preprocess_worker_kind="process") as enc:
        assert enc.preprocessor.worker_kind == "process"
        got = enc.encode(items, errors="skip")
        got_iter = list(enc.encode_iter(items))
    assert got[2] is None and ref[2] is None
    assert all(torch.equal(a, b) for a, b in zip(got, ref) if a is not None)
    assert [i for i, _ in got_iter] == list(range(len(items)))
    assert got_iter[2][1] == ref_iter[2][1]  # the same LoadFailure
    assert all(torch.equal(a[1], b[1]) for a, b in zip(got_iter, ref_iter) if isinstance(a[1], torch.Tensor))
    # the CLI flag: mmenc encode --preprocess-worker-kind process writes the default's embeddings
    paths = [(i, item) for i, item in enumerate(items) if isinstance(item, os.PathLike)]
    out = tmp_path / "emb.safetensors"
    assert main(["encode", *[str(p) for _, p in paths], "--model", folder, "--device", "cpu", "--output", str(out),
                 "--preprocess-worker-kind", "process", "--quiet"]) == 0
    written = load_file(str(out))
    for i, path in paths:
        assert torch.equal(written[str(path)], ref[i]), f"{path}: differs from the default Encoder's embedding"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("resize", ["device", "cpu", "split"])
def test_process_mode_on_cuda_bitwise_equals_thread_mode(tmp_path, resize):
    """The CUDA path: decoded (or CPU-resized) images cross from the workers' segments through pinned
    memory; with torchvision installed its decoder runs in the workers (decode="auto")."""
    items, _ = _mixed(tmp_path)
    proc = get_processor("qwen2_5_vl")
    before = _shm()
    with Preprocessor(proc, device="cuda", workers=2, max_pixels=200 * 200, resize=resize,
                      worker_kind="thread") as pre:
        ref = pre.run(items, errors="skip")
        ref_chunks = list(pre.iter_chunks(items, max_batch_patches=64, errors="skip"))
    with Preprocessor(proc, device="cuda", workers=2, max_pixels=200 * 200, resize=resize,
                      worker_kind="process") as pre:
        got = pre.run(items, errors="skip")
        chunks = list(pre.iter_chunks(items, max_batch_patches=64, errors="skip"))
        procs = pre._procs
        assert procs.lent == 0
    print(f"decode={pre.decode} resize={pre.resize}: process mode equals thread mode on CUDA")
    assert _gone(procs.pids) and _shm() == before
    assert got.failures == ref.failures and torch.equal(got.grid_thw, ref.grid_thw)
    assert torch.equal(got.pixel_values, ref.pixel_values)
    assert [c.indices for c in chunks] == [c.indices for c in ref_chunks]
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(chunks, ref_chunks))
