"""`mmenc serve` stopped by SIGTERM with more work than --shutdown-timeout (issue 28 item 1), as a real
process (tests/slow_serve.py: every tower call first keeps torch busy for SLOW_S s). Within the
timeout every accepted request is answered; past it each remaining one gets a JSON 503
`shutting_down` with Retry-After; the log says how many were cut; the process exits 0 within the
timeout + a few seconds, without an abort or a traceback. Also with --frontends 2."""
import concurrent.futures
import json
import os
import signal
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_client import cli_server, data_url, free_port, png, post_json, request, wait_for  # noqa: E402

SLOW_S, TIMEOUT_S, REQUESTS = 4.0, 4.0, 6
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_serve.py")


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
@pytest.mark.parametrize("frontends", [0, 2], ids=["one-process", "frontends-2"])
def test_sigterm_past_the_timeout_answers_every_request(q25, tmp_path, frontends):
    port = free_port()
    log_path = tmp_path / "serve.log"
    flags = ["--port", str(port), "--shutdown-timeout", str(TIMEOUT_S), "--max-wait-ms", "0", "--max-in-flight", "1",
             "--preprocess-threads", "2", "--frontends", str(frontends)]
    with cli_server([q25, str(SLOW_S), "--", *flags], port, log_path, script=SCRIPT) as proc:
        wait_for(lambda: request(port, "GET", "/health").status == 200, 90, "/health to turn 200")
        with concurrent.futures.ThreadPoolExecutor(REQUESTS) as pool:
            # one tower call of the first image [t1, t1 + 4 s] (t1 < 1 s), then one of the other five [t1 + 4 s,
            # t1 + 8 s]; SIGTERM at 2 s: the first is done within the timeout, the cut (6 s) falls inside the
            # second call, with a second or more to spare on each side on a loaded machine
            first = pool.submit(post_json, port, {"images": [data_url(png(56, 84, seed=0))], "format": "base64"})
            time.sleep(0.3)
            rest = [pool.submit(post_json, port, {"images": [data_url(png(56, 84, seed=i))], "format": "base64"})
                    for i in range(1, REQUESTS)]
            time.sleep(1.7)
            stopped = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            replies = [f.result(timeout=60) for f in [first, *rest]]
            assert proc.wait(timeout=TIMEOUT_S + 15) == 0, open(log_path).read()[-3000:]
            took = time.monotonic() - stopped
    log = open(log_path).read()
    # the timeout, then a second for the running tower call and the process exit (seconds on a loaded 2-core box)
    assert took < TIMEOUT_S + 10, f"exited {took:.1f} s after SIGTERM; log: {log[-3000:]}"
    assert replies[0].status == 200, replies[0].body[:300]  # done within the timeout: answered
    for reply in replies[1:]:
        assert reply.status == 503, (reply.status, reply.body[:300])
        assert reply.json()["error"]["type"] == "shutting_down", reply.body
        assert reply.headers.get("content-type", "").startswith("application/json")
        assert int(reply.headers["retry-after"]) >= 1
    for bad in ("Traceback", "terminate called", "CancelledError", "Internal Server Error"):
        assert bad not in log, log[-3000:]
    cut = sum(int(n) for n in __import__("re").findall(r"(\d+) cut at the", log))
    assert cut == REQUESTS - 1, log[-3000:]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGTERM")
def test_sigterm_within_the_timeout_answers_everything_200(q25, tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    flags = ["--port", str(port), "--shutdown-timeout", "20", "--max-wait-ms", "0", "--preprocess-threads", "2"]
    with cli_server([q25, "1.0", "--", *flags], port, log_path, script=SCRIPT) as proc:
        wait_for(lambda: request(port, "GET", "/health").status == 200, 90, "/health to turn 200")
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            pending = [pool.submit(post_json, port, {"images": [data_url(png(56, 84, seed=i))], "format": "base64"})
                       for i in range(3)]
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            replies = [f.result(timeout=60) for f in pending]
            assert proc.wait(timeout=30) == 0
    assert [r.status for r in replies] == [200, 200, 200], [r.body[:200] for r in replies]
    log = open(log_path).read()
    assert "3 request(s) answered while draining, 0 cut" in log, log[-3000:]


def test_a_request_after_the_signal_is_refused_and_the_cut_answers_503(q25):
    """In process (the service's Drain begun by hand, as uvicorn's shutdown or a Ray replica's drain
    does): a request arriving while draining gets 503 shutting_down at once; one in flight at the cut
    gets 503 shutting_down too, and its images are dropped."""

    from mmenc.serving.settings import ServeSettings
    from serve_client import running_server

    from slow_serve import slow_encoder

    settings = ServeSettings(port=free_port(), preprocess_threads=1, max_wait_ms=0, shutdown_timeout_s=1.0)
    with running_server(settings, lambda: slow_encoder(q25, 3.0)) as (port, service):
        wait_for(lambda: service.state == "ready", 90, "the encoder to load")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            slow = pool.submit(post_json, port, {"images": [data_url(png(56, 84, seed=1))], "format": "base64"})
            wait_for(lambda: service.drain.active == 1, 10, "the request to be in flight")
            service.drain.begin(1.0)
            late = post_json(port, {"images": [data_url(png(56, 84, seed=2))], "format": "base64"})
            assert late.status == 503 and late.json()["error"]["type"] == "shutting_down", late.body
            assert "takes no new requests" in late.json()["error"]["message"]
            late_embeddings = request(port, "POST", "/v1/embeddings", json.dumps({"input": "a cat"}).encode(),
                                      {"content-type": "application/json"})  # /v1/embeddings: the same drain
            assert late_embeddings.status == 503, late_embeddings.body
            assert late_embeddings.json()["error"]["type"] == "shutting_down", late_embeddings.body
            cut = slow.result(timeout=30)
        assert cut.status == 503 and cut.json()["error"]["type"] == "shutting_down", cut.body
        assert "--shutdown-timeout 1 s" in cut.json()["error"]["message"] and cut.headers["retry-after"] == "1"
        assert (service.drain.cut, service.drain.refused, service.drain.active) == (1, 2, 0)
