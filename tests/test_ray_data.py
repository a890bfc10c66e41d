"""`mmenc encode --ray` on a local Ray (loopback only, 2 CPUs): an offline job over a few hundred
small images equals Encoder.encode, resumes after being stopped halfway (finished shards skipped,
none half-written), names every bad file and goes on; a folder of another job is refused."""
import json
import os

import pytest

pytest.importorskip("ray.data")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is used: bind to loopback

import torch  # noqa: E402
from serve_client import png, rel_err  # noqa: E402

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.ray.data import OfflineSettings, read_shards, run_job  # noqa: E402

IMAGES = 240
BAD = {"bad-not-an-image.png": b"this is text", "bad-truncated.png": None, "bad-empty.jpg": b""}


@pytest.fixture(scope="module")
def ray_local():
    from mmenc.ray.cluster import start_local

    start_local(num_cpus=2)
    import ray

    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """IMAGES small PNGs of four sizes in two sub-folders, and three bad files."""
    root = tmp_path_factory.mktemp("corpus")
    for i in range(IMAGES):
        folder = root / f"part{i % 2}"
        folder.mkdir(exist_ok=True)
        h, w = 28 * (1 + i % 2), 28 * (1 + (i // 2) % 2)
        (folder / f"img{i:04d}.png").write_bytes(png(h, w, seed=i))
    for name, data in BAD.items():
        (root / name).write_bytes(data if data is not None else png(56, 56, seed=9)[:40])
    return root, _list([str(root)])


def _list(inputs):
    from mmenc.cli.encode import IMAGE_EXTENSIONS, collect_images
    from mmenc.cli.encode_ray import list_inputs

    return list_inputs(inputs, collect_images, IMAGE_EXTENSIONS)


def _settings(out, **kw):
    return OfflineSettings(output=str(out), **{"shard_size": 32, "encoders": 1, "batch_size": 16, **kw})


def test_stopped_halfway_then_resumed_equals_encoder_encode(ray_local, q25, corpus, tmp_path):
    root, keys = corpus
    assert len(keys) == IMAGES + len(BAD)
    out = tmp_path / "shards"
    kwargs = {"model": q25, "device": "cpu"}

    def stop_after_three(index, report):
        if report.shards_written == 3:
            raise KeyboardInterrupt  # what Ctrl-C does to the driver

    with pytest.raises(KeyboardInterrupt):
        run_job(keys, kwargs, _settings(out), on_shard=stop_after_three)
    first = sorted(p.name for p in out.glob("shard-*"))
    assert first == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"], first
    assert not list(out.glob(".*tmp")), "a temporary shard file was left behind"

    report = run_job(keys, kwargs, _settings(out))
    shards = -(-len(keys) // 32)
    assert (report.shards_skipped, report.shards_written) == (3, shards - 3), report
    print(f"offline job on CPU (resumed part): {report.line()}")

    tensors, failed = read_shards(out)
    bad_keys = {str(root / name) for name in BAD}
    assert set(failed) == bad_keys, failed
    for key, message in failed.items():
        assert key in message, f"the failure of {key} does not name it: {message}"
    good = [k for k in keys if k not in bad_keys]
    assert {k for k in tensors if not k.endswith(".grid_thw")} == set(good)
    ref = Encoder(q25, device="cpu")
    want = ref.encode(good)
    _, grids = ref.preprocess(good)
    for key, w, grid in zip(good, want, grids):
        assert tensors[key].dtype == torch.float32 and tensors[key].shape == w.shape
        assert rel_err(tensors[key], w) < 1e-5, f"{key}: {rel_err(tensors[key], w):.2e} from Encoder.encode"
        assert torch.equal(tensors[f"{key}.grid_thw"], grid)

    again = run_job(keys, kwargs, _settings(out))
    assert (again.shards_written, again.shards_skipped) == (0, shards)


def test_cli_encode_ray_and_refusing_another_jobs_folder(ray_local, q25, corpus, tmp_path, capfd):
    from mmenc.cli.main import main

    root, keys = corpus
    out = tmp_path / "cli"
    part = str(root / "part0")
    code = main(["encode", "--ray", part, str(root / "bad-empty.jpg"), "--model", q25, "--device", "cpu",
                 "--output", str(out), "--shard-size", "50", "--encoders", "1", "--quiet"])
    captured = capfd.readouterr()
    assert code == 1, captured.err  # one bad file: exit 1, the others written
    import logging

    # --quiet: Ray Data's INFO lines (execution plan, finish) off the terminal. pytest's log capture keeps
    # them out of captured.err either way, so the loggers' levels are what is checked here.
    assert all(logging.getLogger(n).getEffectiveLevel() >= logging.ERROR for n in ("ray", "ray.data")), \
        "--quiet left Ray's loggers below ERROR"
    assert "bad-empty.jpg" in captured.err and "failed=1" in captured.out and "shards_written=3" in captured.out
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["images"] == IMAGES // 2 + 1 and manifest["shard_size"] == 50
    tensors, failed = read_shards(out)
    assert len([k for k in tensors if not k.endswith(".grid_thw")]) == IMAGES // 2 and len(failed) == 1

    with pytest.raises(ValueError, match="another job"):
        run_job(keys, {"model": q25, "device": "cpu"}, _settings(out, shard_size=50))
    assert main(["encode", "--ray", part, "--model", q25, "--output", str(tmp_path / "x" / "f.png"),
                 "--shard-size", "0", "--quiet"]) == 2


def test_shards_say_where_the_weights_came_from_and_scale_16_bit_images(ray_local, q25, tmp_path):
    """The Ray job's CPU tasks load images with the Encoder's high_bit_depth (they once ignored it), and
    each shard's metadata has `weights`, as `mmenc encode`'s file does."""
    import numpy as np
    from PIL import Image
    from safetensors import safe_open

    path = tmp_path / "ramp16.png"
    Image.fromarray(np.linspace(0, 65535, 56 * 56).reshape(56, 56).astype(np.uint16)).save(path)
    keys = [str(path)]
    for kwargs, weights in (({"model": q25, "device": "cpu", "high_bit_depth": "scale"}, "checkpoint"),
                            ({"model": q25, "device": "cpu", "load_format": "dummy"}, "random")):
        out = tmp_path / weights
        run_job(keys, kwargs, _settings(out))
        with safe_open(str(out / "shard-00000.safetensors"), framework="pt") as f:
            assert f.metadata()["weights"] == weights, f.metadata()
        if weights == "checkpoint":
            got, _ = read_shards(out)
            want = Encoder(**kwargs).encode(keys)[0]
            assert rel_err(got[str(path)], want) < 1e-5  # "clip" (the default) gives another picture
            clipped = Encoder(q25, device="cpu").encode(keys)[0]
            assert rel_err(clipped, want) > 1e-2


def test_uri_inputs_are_listed_and_read(tmp_path):
    """file:// stands for any pyarrow filesystem (s3://, gs://, ...): folders listed recursively,
    image extensions only; the CPU stage reads the bytes and names a missing file by its key."""
    from mmenc.ray.stages import preprocess_batch, read_bytes

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.png").write_bytes(png(28, 28, seed=1))
    (tmp_path / "sub" / "b.jpg").write_bytes(png(28, 56, seed=2))
    (tmp_path / "notes.txt").write_text("not an image")
    keys = sorted(_list([f"file://{tmp_path}"]))
    assert keys == [f"file://{tmp_path}/a.png", f"file://{tmp_path}/sub/b.jpg"], keys
    assert read_bytes(keys[0]) == (tmp_path / "a.png").read_bytes()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _list([f"file://{tmp_path}/missing"])

    from mmenc.engine.tower import build_tower

    processor = build_tower("Qwen/Qwen2.5-VL-7B-Instruct", load_format="dummy", device="meta").processor
    import numpy as np

    gone = f"file://{tmp_path}/gone.png"
    out = preprocess_batch({"key": np.array(keys + [gone], dtype=object)}, processor=processor, max_pixels=-1,
                           pixel_dtype="float32")
    assert list(out["error"][:2]) == ["", ""] and gone in out["error"][2], out["error"]
    assert out["grid"][0].tolist() == [1, 4, 4] and len(out["pixels"][0]) == 16 * 1176 * 4  # 28 px -> 56 px (min_pixels)
