"""`mmenc encode` loses nothing: output checked before work, written atomically with what was encoded
(also after Ctrl-C or an error), per-image failures named, progress while the tower is slow."""
import functools
import logging
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import mmenc.cli.encode as encode_cli
from mmenc.cli.main import main
from mmenc.cli.progress import Progress
from mmenc.engine.encoder import Encoder

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _image(path, h, w, seed=0):
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.fixture
def three(tmp_path):
    return [_image(tmp_path / f"{n}.png", h, w, i) for i, (n, h, w) in enumerate([("a", 56, 84), ("b", 64, 64),
                                                                                    ("c", 40, 40)])]


def _encode(capsys, *argv):
    rc = main(["encode", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("mmenc encode: loading ")]
    assert len(lines) == 1 and "Traceback" not in err, f"expected one error line, got:\n{err}"
    return lines[0]


# -- the output path is checked before any work --------------------------------------------------

def test_output_folder_missing(folder, three, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(encode_cli, "encoder_kwargs", lambda *a: pytest.fail("the model was loaded first"))
    rc, out, err = _encode(capsys, *three, "--model", folder, "-o", str(tmp_path / "no" / "such" / "e.safetensors"))
    assert rc == 2 and out == ""
    line = _one_error_line(err)
    assert "--output" in line and "does not exist; create it first (mkdir -p" in line


def test_output_is_a_folder(folder, three, tmp_path, capsys):
    rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(tmp_path))
    assert rc == 2 and "is a folder; give a file path inside it" in _one_error_line(err)


def test_output_is_an_input(folder, three, tmp_path, capsys):
    before = open(three[1], "rb").read()
    rc, _, err = _encode(capsys, str(tmp_path), "--model", folder, "-o", three[1])
    assert rc == 2 and "is one of the inputs" in _one_error_line(err)
    assert open(three[1], "rb").read() == before, "the input image was touched"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_folder_not_writable(folder, three, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(locked / "e.safetensors"))
    finally:
        locked.chmod(0o700)
    assert rc == 2 and "is not writable" in _one_error_line(err)


# -- a run always writes what it encoded --------------------------------------------------------

def _fail_on_call(monkeypatch, call: int, error: BaseException):
    """Encoder.encode_pixels raises `error` on its `call`-th call (1-based) and works otherwise."""
    real = Encoder.encode_pixels
    calls = []

    def encode_pixels(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == call:
            raise error
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Encoder, "encode_pixels", encode_pixels)
    monkeypatch.setattr(encode_cli, "CALL_SECONDS", 1e-9)  # one image per tower call
    return calls


def test_ctrl_c_keeps_what_was_encoded(folder, three, tmp_path, capsys, monkeypatch):
    _fail_on_call(monkeypatch, 3, KeyboardInterrupt())
    out = tmp_path / "e.safetensors"
    rc, stdout, err = _encode(capsys, *three, "--model", folder, "-o", str(out))
    assert rc == 130
    assert "interrupted after 2 of 3 images" in err and "wrote the 2 encoded image(s)" in err
    assert set(load_file(str(out))) == {three[0], f"{three[0]}.grid_thw", three[1], f"{three[1]}.grid_thw"}
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["complete"] == "false" and f.metadata()["images"] == "2"
    assert "images=2" in stdout and f"output={out}" in stdout
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")], "a temporary file was left behind"


def test_fatal_error_keeps_what_was_encoded(folder, three, tmp_path, capsys, monkeypatch):
    _fail_on_call(monkeypatch, 2, RuntimeError("device lost"))
    out = tmp_path / "e.safetensors"
    with pytest.raises(RuntimeError, match="device lost"):
        main(["encode", *three, "--model", folder, "-o", str(out)])
    err = capsys.readouterr().err
    assert "stopped by an error after 1 of 3 images" in err
    assert set(load_file(str(out))) == {three[0], f"{three[0]}.grid_thw"}


def test_interrupted_write_leaves_the_old_file(folder, three, tmp_path, capsys, monkeypatch):
    out = tmp_path / "e.safetensors"
    out.write_bytes(b"old results")

    def broken_save(tensors, filename, metadata=None):
        open(filename, "wb").write(b"half")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("safetensors.torch.save_file", broken_save)
    with pytest.raises(OSError, match="No space left"):
        main(["encode", three[0], "--model", folder, "-o", str(out)])
    assert out.read_bytes() == b"old results"
    assert sorted(os.listdir(tmp_path)) == sorted(["a.png", "b.png", "c.png", "e.safetensors"])


def test_every_input_failing_writes_nothing_and_says_so(folder, tmp_path, capsys):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG not really")
    out = tmp_path / "e.safetensors"
    out.write_bytes(b"an earlier run")
    rc, stdout, err = _encode(capsys, str(bad), "--model", folder, "-o", str(out))
    assert rc == 1 and "output=(none)" in stdout and "images=0" in stdout
    assert "bad.png" in err and "nothing was written" in err
    assert f"the existing '{out}' is from an earlier run and was left unchanged" in err
    assert out.read_bytes() == b"an earlier run"


def test_complete_run_says_so_in_metadata(folder, three, tmp_path, capsys):
    out = tmp_path / "e.safetensors"
    rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(out))
    assert rc == 0 and "wrote the" not in err
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["complete"] == "true" and f.metadata()["images"] == "3"


# -- per-image failures: one file fails, the rest are written -----------------------------------

def test_extreme_aspect_ratio_fails_only_that_image(folder, three, tmp_path, capsys):
    thin = _image(tmp_path / "thin.png", 28, 28 * 210)  # aspect ratio 210 > 200
    out = tmp_path / "e.safetensors"
    rc, stdout, err = _encode(capsys, three[0], thin, three[1], "--model", folder, "-o", str(out))
    assert rc == 1
    failed = [line for line in err.splitlines() if "failed:" in line]
    assert len(failed) == 1 and "thin.png" in failed[0] and "aspect ratio" in failed[0], err
    assert set(load_file(str(out))) == {three[0], f"{three[0]}.grid_thw", three[1], f"{three[1]}.grid_thw"}
    assert "images=2" in stdout


def test_decompression_bomb_limit_flag(folder, three, tmp_path, capsys, monkeypatch):
    out = tmp_path / "e.safetensors"
    rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(out), "--max-image-pixels", "3000")
    assert rc == 1
    failed = [line for line in err.splitlines() if "failed:" in line]
    assert len(failed) == 2 and all("decompression bomb" in line for line in failed)
    assert {"a.png", "b.png"} == {os.path.basename(line.split("'")[1]) for line in failed}
    assert set(load_file(str(out))) == {three[2], f"{three[2]}.grid_thw"}
    # raising the limit beyond PIL's own admits a trusted large image (PIL's default made tiny here)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    rc, _, err = _encode(capsys, three[0], "--model", folder, "-o", str(out))
    assert rc == 1 and "decompression bomb" in err and "--max-image-pixels" in err
    rc, _, _ = _encode(capsys, three[0], "--model", folder, "-o", str(out), "--max-image-pixels", "10000")
    assert rc == 0 and Image.MAX_IMAGE_PIXELS == 1000, "PIL's limit is restored after the run"


def test_animated_gif_is_named(folder, tmp_path, capsys, mmenc_caplog):
    frames = [Image.new("RGB", (40, 40), (60 * i, 0, 0)) for i in range(3)]
    gif = tmp_path / "anim.gif"
    frames[0].save(gif, save_all=True, append_images=frames[1:], duration=40)
    rc, _, _ = _encode(capsys, str(gif), "--model", folder, "-o", str(tmp_path / "e.safetensors"))
    assert rc == 0
    assert any("anim.gif' has 3 frames" in r.getMessage() for r in mmenc_caplog.records)


# -- progress -------------------------------------------------------------------------------------

def test_calls_shrink_while_the_tower_is_slow(folder, three, tmp_path, capsys, monkeypatch):
    calls = _fail_on_call(monkeypatch, 0, RuntimeError("never"))
    rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(tmp_path / "e.safetensors"))
    assert rc == 0 and len(calls) == 3, "one image per tower call when a call is slower than CALL_SECONDS"
    assert "mmenc encode: 3/3 images (100%)" in err and "images/s" in err


def test_call_sizer():
    sizer = encode_cli.CallSizer(limit=16)
    assert sizer.size() == 1
    sizer.observe(images=1, seconds=0.5)
    assert sizer.size() == int(encode_cli.CALL_SECONDS / 0.5)
    sizer.observe(images=2, seconds=30.0)
    assert sizer.size() == 1
    sizer.observe(images=4, seconds=0.001)
    assert sizer.size() == 16


def test_progress_lines_while_a_call_runs(folder, three, tmp_path, capsys, monkeypatch):
    real = Encoder.encode_pixels

    def slow(self, *args, **kwargs):
        time.sleep(0.3)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(Encoder, "encode_pixels", slow)
    monkeypatch.setattr(encode_cli, "Progress", functools.partial(Progress, interval=0.05))
    rc, _, err = _encode(capsys, *three, "--model", folder, "-o", str(tmp_path / "e.safetensors"))
    lines = [line for line in err.splitlines() if line.startswith("mmenc encode: ") and "/3 images" in line]
    assert rc == 0 and len(lines) >= 6, err
    assert any("0/3 images" in line for line in lines) and any("ETA" in line for line in lines)
    assert lines[-1].startswith("mmenc encode: 3/3 images (100%)")


def test_progress_line_format():
    progress = Progress(total=10, unit="images", label="x", enabled=False)
    assert progress.line().startswith("x: 0/10 images (0%), 0 s elapsed, ETA after the first one")
    progress._start -= 4.0
    progress.advance(2)
    line = progress.line()
    assert "2/10 images (20%)" in line and "0.50 images/s" in line and "ETA 16 s" in line


def test_quiet_hides_progress_and_info(folder, three, tmp_path, capsys):
    rc, out, err = _encode(capsys, *three, "--model", folder, "-o", str(tmp_path / "e.safetensors"), "-q")
    assert rc == 0 and "images=3" in out
    assert "/3 images" not in err
    assert logging.getLogger("mmenc").level == logging.WARNING


# -- clear one-line errors ----------------------------------------------------------------------

@pytest.mark.parametrize("device, needle", [
    ("bogus", "--device 'bogus' is not a torch device"),
    ("meta", "the meta device holds no data"),
])
def test_bad_device_is_one_line(folder, three, capsys, device, needle):
    rc, _, err = _encode(capsys, three[0], "--model", folder, "--device", device)
    assert rc == 2 and needle in _one_error_line(err)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="CUDA is available here")
def test_cuda_device_without_cuda(folder, three, capsys, monkeypatch):
    import torch

    rc, _, err = _encode(capsys, three[0], "--model", folder, "--device", "cuda")
    line = _one_error_line(err)
    if torch.version.cuda is None:
        assert rc == 2 and "built without CUDA" in line and "--device cpu" in line
    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build on a machine without a GPU
    rc, _, err = _encode(capsys, three[0], "--model", folder, "--device", "cuda:0")
    assert rc == 2 and "no CUDA device is visible" in _one_error_line(err)


def test_damaged_checkpoint_is_one_line(folder, three, tmp_path, capsys):
    broken = tmp_path / "ckpt"
    broken.mkdir()
    (broken / "config.json").write_text(open(os.path.join(folder, "config.json")).read())
    data = open(os.path.join(folder, "model.safetensors"), "rb").read()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 3])
    rc, _, err = _encode(capsys, three[0], "--model", str(broken), "-o", str(tmp_path / "e.safetensors"))
    assert rc == 2
    assert "model.safetensors' is damaged" in _one_error_line(err)


def test_through_python_m(folder, three, tmp_path):
    """The real entry point in a fresh interpreter: a bad output folder is one line, a good run writes."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "mmenc.cli.main", "encode", *three, "--model", folder]
    bad = subprocess.run(cmd + ["-o", str(tmp_path / "missing" / "e.safetensors")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert bad.returncode == 2 and "does not exist; create it first" in _one_error_line(bad.stderr)
    out = tmp_path / "e.safetensors"
    good = subprocess.run(cmd + ["-o", str(out)], capture_output=True, text=True, env=env, timeout=300)
    assert good.returncode == 0, good.stderr
    assert "images=3" in good.stdout and "3/3 images" in good.stderr
    assert len(load_file(str(out))) == 6


def test_an_input_given_twice_is_encoded_once(folder, three, tmp_path, capsys):
    out = tmp_path / "e.safetensors"
    rc, stdout, _ = _encode(capsys, three[0], three[0], "--model", folder, "-o", str(out))
    assert rc == 0 and "images=1" in stdout
    with safe_open(str(out), "pt") as f:
        assert f.metadata()["complete"] == "true"
