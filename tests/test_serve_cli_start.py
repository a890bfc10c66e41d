"""`mmenc serve` starting as a command (issue 28 item 7): a port already in use is found before the
model loads and reported in one `mmenc serve: error:` line (exit 2, as every flag error); `-q`
silences INFO from mmenc and from uvicorn."""
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_client import cli_server, free_port, request, wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [ROOT, os.environ.get("PYTHONPATH")] if p))


@pytest.mark.parametrize("extra", [[], ["--frontends", "1"], ["--ray"]], ids=["one-process", "frontends", "ray"])
def test_port_in_use_is_one_error_line_before_loading(q25, extra):
    if extra == ["--ray"]:
        pytest.importorskip("ray.serve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "mmenc", "serve", "--model", q25, "--device", "cpu", "--port",
                               str(port), *extra], capture_output=True, text=True, env=ENV, timeout=120)
        took = time.monotonic() - start
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("mmenc serve: error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "--port" in errors[0], done.stderr[-2000:]
    assert " ready in " not in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]  # not loaded
    assert "listening" not in done.stderr, done.stderr[-2000:]  # it never said it listened
    assert took < 60


def test_quiet_silences_info_from_mmenc_and_uvicorn(q25, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    with cli_server(["--model", q25, "--device", "cpu", "--port", str(port), "-q", "--preprocess-threads", "1"],
                    port, log_path) as proc:
        wait_for(lambda: request(port, "GET", "/health").status == 200, 90, "/health to turn 200")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    lines = [line for line in open(log_path).read().splitlines() if line.strip()]
    assert not [line for line in lines if line.startswith("INFO")], lines
