"""`mmenc serve` as a process: the CLI starts it, SIGTERM lets the request in flight finish (200 with
its embeddings), then the process exits 0 and stops listening."""
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mmenc.testing.checkpoints import save_qwen2_5_vl  # noqa: E402
from serve_client import (  # noqa: E402
    free_port,
    png,
    request,
    sigterm_with_one_request_in_flight,
    wait_for,
)


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_drains_the_request_in_flight(tmp_path):
    folder = str(save_qwen2_5_vl(tmp_path / "q25")[0])
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "mmenc.cli.main", "serve", "--model", folder, "--device", "cpu",
                             "--port", str(port), "--max-wait-ms", "1500", "--preprocess-threads", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def healthy():
            assert proc.poll() is None, f"server exited early: {open(tmp_path / 'serve.log').read()[-2000:]}"
            try:
                return request(port, "GET", "/health", timeout=2).status == 200
            except OSError:
                return False

        wait_for(healthy, 60, "the server to become healthy")
        sigterm_with_one_request_in_flight(proc, port, png(56, 84, seed=3), hidden=24)
        with pytest.raises(OSError):
            request(port, "GET", "/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


_SLOW_LOAD = """
import sys, time, torch
from mmenc.serving import ServeSettings, serve

def make_encoder():  # torch busy in the loader thread, as when a tower is built or compiled
    x, end = torch.randn(256, 256), time.time() + float(sys.argv[2])
    while time.time() < end:
        x = (x @ x).tanh()
    from mmenc.engine.encoder import Encoder
    return Encoder(sys.argv[3], device="cpu")

sys.exit(serve(ServeSettings(port=int(sys.argv[1]), preprocess_threads=1, shutdown_timeout_s=float(sys.argv[4])),
               make_encoder))
"""


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
@pytest.mark.parametrize("load_s, shutdown_timeout_s", [(60, 1), (3, 30)], ids=["load-outlasts-timeout", "load-ends"])
def test_sigterm_while_loading_exits_cleanly(tmp_path, load_s, shutdown_timeout_s):
    """SIGTERM while the tower loads used to abort the process ("terminate called without an active
    exception", status 134): the interpreter tore torch down under the busy loader thread. Now the
    server waits for the load up to shutdown_timeout_s, then exits 0 either way."""
    folder = str(save_qwen2_5_vl(tmp_path / "q25")[0])
    script = tmp_path / "slow_load.py"
    script.write_text(_SLOW_LOAD)
    port = free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, str(script), str(port), str(load_s), folder, str(shutdown_timeout_s)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        def loading():
            assert proc.poll() is None, f"server exited early: {open(tmp_path / 'serve.log').read()[-2000:]}"
            try:
                reply = request(port, "GET", "/health", timeout=2)
            except OSError:
                return False
            assert reply.status == 503 and reply.json()["status"] == "loading", reply.body
            return True

        wait_for(loading, 60, "the server to answer /health while loading")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=shutdown_timeout_s + load_s + 30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    output = open(tmp_path / "serve.log").read()
    assert "terminate called" not in output and "Traceback" not in output, output[-2000:]
    assert "stopping while the encoder loads" in output, output[-2000:]
