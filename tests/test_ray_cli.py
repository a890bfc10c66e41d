"""`mmenc serve --ray` as a command: starts its own local Ray (loopback only), serves, and on SIGTERM
drains, stops Ray and exits 0 leaving no Ray process behind; flags that need --ray are refused without it."""
import glob
import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("fastapi")

from serve_client import data_url, decode_item, free_port, png, post_json, rel_err, request, wait_for  # noqa: E402

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.testing.checkpoints import save_qwen2_5_vl  # noqa: E402


def _processes_of_session(driver_pid: int) -> list[str]:
    """Command lines of live processes whose Ray session folder was named after `driver_pid`."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"_{driver_pid}/" in cmd and "/ray/session_" in cmd:
            found.append(cmd[:160])
    return found


def _start_serve_ray(tmp_path, port: int, *args: str) -> subprocess.Popen:
    """`mmenc serve --ray --replicas 1 --device cpu --port PORT ARGS` (log: tmp_path/serve.log), once it
    answers /health; the test owns the process (kill it in a finally)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "mmenc.cli.main", "serve", "--ray", "--replicas", "1", "--device",
                             "cpu", "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT, env=env)

    def healthy():
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        try:
            return request(port, "GET", "/health", timeout=5).status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, 180, "mmenc serve --ray to answer /health")
    except BaseException:
        proc.kill()
        proc.wait(timeout=30)
        raise
    return proc


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_serve_ray_command_serves_then_stops_cleanly(tmp_path):
    q25 = str(save_qwen2_5_vl(tmp_path / "q25")[0])
    port = free_port()
    proc = _start_serve_ray(tmp_path, port, "--model", q25, "--preprocess-threads", "1")
    try:
        image = png(56, 84, seed=7)
        reply = post_json(port, {"images": [data_url(image)], "format": "base64"})
        assert reply.status == 200, reply.body[:300]
        want = Encoder(q25, device="cpu").encode([image])[0]
        assert rel_err(decode_item(reply.json()["data"][0], "base64"), want) < 1e-5
        assert _processes_of_session(proc.pid), "found no Ray process of the command's session to watch"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    wait_for(lambda: not _processes_of_session(proc.pid), 30, "the command's Ray processes to exit")


def test_ray_only_flags_need_ray():
    from mmenc.cli.main import main

    assert main(["serve", "--replicas", "2"]) == 2
    assert main(["serve", "--ray", "--autoscale", "3:1"]) == 2


def _big_images(n: int) -> list[str]:
    """Images whose tower call takes about a second each on a CPU replica (the tiny tower, 2048 px)."""
    import numpy as np
    from PIL import Image
    import io

    urls = []
    for seed in range(n):
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(seed).integers(0, 255, (2048, 2048, 3), dtype=np.uint8)).save(
            buf, format="PNG", compress_level=0)
        urls.append("data:image/png;base64," + __import__("base64").b64encode(buf.getvalue()).decode())
    return urls


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("ingress", ["proxy"])  # "direct" passed too (65 s; left out of CI for time)
def test_serve_ray_sigterm_drains_the_requests_in_flight(tmp_path, ingress):
    """Issue 25 item 3 / issue 28 item 1: SIGTERM to `mmenc serve --ray` while requests are in flight:
    each is answered (200; before, 'Server disconnected without sending a response'), the log lists
    the replica's drain, then the command exits 0 leaving no Ray process. (The refusal and cut answers
    are the same Drain code as `mmenc serve`: tests/test_serve_drain.py.)"""
    import concurrent.futures
    import time

    q25 = str(save_qwen2_5_vl(tmp_path / "q25")[0])
    port = free_port()
    proc = _start_serve_ray(tmp_path, port, "--ray-ingress", ingress, "--ray-cache", "replica", "--model", q25,
                            "--preprocess-threads", "2", "--shutdown-timeout", "60")
    try:
        images = _big_images(3)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            pending = [pool.submit(post_json, port, {"images": [url], "format": "base64"}, None, 120) for url in images]
            time.sleep(1.0)
            proc.send_signal(signal.SIGTERM)
            replies = [f.result(timeout=150) for f in pending]
        assert [r.status for r in replies] == [200] * len(replies), [r.body[:200] for r in replies]
        assert proc.wait(timeout=120) == 0, (tmp_path / "serve.log").read_text()[-3000:]
        # the replica's drain line reaches the driver's log through Ray's log forwarding, which is best-effort
        # once Serve kills the replica's actor (seen lost on a loaded 2-core machine); where it came, none was cut
        drained = re.findall(r"(\d+) request\(s\) answered while draining, (\d+) cut", (tmp_path / "serve.log").read_text())
        assert all(cut == "0" for _, cut in drained), drained
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    wait_for(lambda: not _processes_of_session(proc.pid), 30, "the command's Ray processes to exit")
