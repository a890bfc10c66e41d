"""`mmenc encode --ray` as a command on a small job (20 images), stopped by SIGTERM mid-run (issue 28
item 3): shards are written as they finish, so the stop leaves finished shards (exit 143, the
message says a rerun resumes), and the rerun skips them and completes the job. The shards' mode
follows the umask (item 9); a bfloat16 checkpoint computed in float32 on CPU actors is logged as
float32 (item 13)."""
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("ray.data")

from test_cli_signals import env_with_mmenc, write_images  # noqa: E402

from mmenc.testing.checkpoints import save_qwen2_5_vl  # noqa: E402

IMAGES = 20


def _encode_ray(model, images, out, log_path):
    return subprocess.Popen([sys.executable, "-m", "mmenc", "encode", "--ray", str(images), "--model", model,
                             "--device", "cpu", "-o", str(out)], stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                            env=env_with_mmenc(), umask=0o002)


def _shards(out) -> list[str]:
    return sorted(p for p in os.listdir(out) if p.startswith("shard-")) if os.path.isdir(out) else []


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_small_ray_job_killed_mid_run_leaves_shards_and_resumes(tmp_path):
    from mmenc.ray.data import read_shards

    model = str(save_qwen2_5_vl(tmp_path / "q25bf", dtype=torch.bfloat16)[0])
    write_images(tmp_path / "images", IMAGES, size=640)  # ~0.2 s per image in the tiny tower on a CPU
    out = tmp_path / "shards"
    first = tmp_path / "first.log"
    proc = _encode_ray(model, tmp_path / "images", out, first)
    try:
        deadline = time.monotonic() + 240
        while len(_shards(out)) < 3:
            assert proc.poll() is None, open(first).read()[-3000:]
            assert time.monotonic() < deadline, open(first).read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 143, open(first).read()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = open(first).read()
    kept = _shards(out)
    assert 3 <= len(kept) < IMAGES, (kept, text[-3000:])
    assert "stopped by SIGTERM; the finished shards are in" in text and "resumes" in text, text[-3000:]
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")], os.listdir(out)  # nothing half-written
    for name in kept + ["manifest.json"]:
        assert os.stat(out / name).st_mode & 0o777 == 0o664, (name, oct(os.stat(out / name).st_mode))

    second = tmp_path / "second.log"
    proc = _encode_ray(model, tmp_path / "images", out, second)
    assert proc.wait(timeout=300) == 0, open(second).read()[-3000:]
    text = open(second).read()
    skipped = int(re.search(r"shards_skipped=(\d+)", text).group(1))
    assert skipped >= len(kept) and f"images={IMAGES - skipped}" in text, text[-3000:]
    tensors, failed = read_shards(out)
    assert not failed and len([k for k in tensors if k.endswith(".grid_thw")]) == IMAGES
    assert {t.dtype for k, t in tensors.items() if not k.endswith(".grid_thw")} == {torch.float32}
    assert "bfloat16" not in open(first).read() + text, "the job computes float32 on CPU actors; its log must say so"
