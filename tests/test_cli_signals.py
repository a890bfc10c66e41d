"""`mmenc encode` as a process stopped by the signals `kill`, `timeout`, systemd, Kubernetes and Slurm
send (SIGTERM) or a closed terminal (SIGHUP): like Ctrl-C, what was encoded is written (metadata
complete=false), the command says so and exits 128 + the signal (143 / 129). Issue 28 item 2; the
file's mode follows the umask (item 9)."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from PIL import Image

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def env_with_mmenc() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))


def write_images(folder, n: int, size: int = 336, distinct: int | None = None) -> list[str]:
    """`n` PNGs in `folder`; with `distinct`, only that many are written and the rest are hard links to
    them (a long job that costs little to make: `mmenc encode` reads every file, it caches nothing)."""
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        paths.append(str(folder / f"{i:05d}.png"))
        if distinct is not None and i >= distinct:
            os.link(paths[i % distinct], paths[-1])
        else:
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def wait_for_progress(log_path, proc, total: int, timeout: float = 120.0) -> int:
    """The count of the first progress line showing 0 < done < total (the job is mid-run)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited early ({proc.returncode}): {open(log_path).read()[-2000:]}"
        done = [int(m) for m in re.findall(rf"(\d+)/{total} images", open(log_path).read())]
        if any(0 < d < total for d in done):
            return max(done)
        time.sleep(0.05)
    raise AssertionError(f"no progress within {timeout} s: {open(log_path).read()[-2000:]}")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)], ids=["SIGTERM", "SIGHUP"])
def test_encode_stopped_by_a_signal_writes_what_was_encoded(q25, tmp_path, sig, code):
    from safetensors import safe_open

    # Long enough that a fast machine (60 images/s in CI) is still mid-run when the signal lands: the
    # signal goes out at the first progress line (every 2 s) that shows 0 < done < total.
    total = 1200
    write_images(tmp_path / "images", total, distinct=48)
    out = tmp_path / "out.safetensors"
    log_path = tmp_path / "encode.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "mmenc", "encode", str(tmp_path / "images"), "--model", q25,
                                 "--device", "cpu", "--batch-size", "1", "--preprocess-worker-kind", "thread",
                                 "-o", str(out)], stdout=log, stderr=subprocess.STDOUT, env=env_with_mmenc(),
                                umask=0o002)
        try:
            seen = wait_for_progress(log_path, proc, total)
            proc.send_signal(sig)
            assert proc.wait(timeout=60) == code, open(log_path).read()[-2000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = open(log_path).read()
    name = signal.Signals(sig).name
    match = re.search(rf"stopped by {name} after (\d+) of {total} images", text)
    assert match, text[-2000:]
    encoded = int(match.group(1))
    assert seen <= encoded < total, text[-2000:]
    assert f"wrote the {encoded} encoded image(s) to {out}" in text, text[-2000:]
    assert "Traceback" not in text, text[-2000:]
    with safe_open(str(out), framework="pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["complete"] == "false" and int(meta["images"]) == encoded
    assert len([k for k in keys if k.endswith(".grid_thw")]) == encoded
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o664), "the output's mode must follow the umask (002)"
