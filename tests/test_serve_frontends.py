"""`mmenc serve --frontends N` as processes: 503 while the engine loads, one queue bound for all
front ends, a client that leaves frees its image in the engine, a front end killed with SIGKILL is
restarted and later requests succeed, SIGTERM drains a request in flight and exits 0 (the metrics
folder removed), and front ends do not outlive an engine that dies."""
import concurrent.futures
import os
import signal
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from serve_client import (  # noqa: E402
    child_pids,
    cli_server,
    data_url,
    free_port,
    hang_up_after,
    metric,
    png,
    post_json,
    request,
    sigterm_with_one_request_in_flight,
    wait_for,
)

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="front ends: Linux (SCM_RIGHTS, /proc)")

_GATED = """
import os, sys, time
from mmenc.serving import ServeSettings, serve

def make_encoder():  # loads once the test creates the gate file
    deadline = time.time() + 60
    while not os.path.exists(sys.argv[3]) and time.time() < deadline:
        time.sleep(0.05)
    from mmenc.engine.encoder import Encoder
    return Encoder(sys.argv[2], device="cpu")

if __name__ == "__main__":  # the front ends are spawned: they import this file again
    settings = ServeSettings(port=int(sys.argv[1]), frontends=2, max_wait_ms=1500, max_queue_images=4,
                             max_images_per_request=4, cache_bytes=0, preprocess_threads=1, shutdown_timeout_s=20)
    sys.exit(serve(settings, make_encoder))
"""


def _frontends(engine_pid: int) -> list[int]:
    """The engine's front-end processes (spawned children; not multiprocessing's resource tracker)."""
    def spawned(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return b"spawn_main" in f.read()
        except OSError:
            return False
    return [pid for pid in child_pids(engine_pid) if spawned(pid)]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


def test_frontends_load_limit_cancel_restart_and_drain(q25, tmp_path):
    port, gate = free_port(), tmp_path / "gate"
    script = tmp_path / "gated.py"
    script.write_text(_GATED)
    with cli_server([str(port), q25, str(gate)], port, tmp_path / "serve.log", script=str(script)) as proc:
        loading = request(port, "GET", "/health")
        assert loading.status == 503 and loading.json()["status"] == "loading", loading.body
        refused = post_json(port, {"images": [data_url(png(56, 56))]})
        assert refused.status == 503 and refused.headers["retry-after"] == "1", refused.body
        gate.touch()
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "/health to turn 200")
        assert len(_frontends(proc.pid)) == 2

        # one bound for the whole server: 4 images in flight in one front end refuse a 5th in any
        images = [png(56, 56, seed=70 + i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post_json, port, {"images": [data_url(d) for d in images]})
            wait_for(lambda: metric(port, "mmenc_in_flight_images") == 4, 10, "4 images in flight")
            for _ in range(4):  # fresh connections: both front ends get asked
                full = post_json(port, {"images": [data_url(images[0])]})
                assert full.status == 503 and full.json()["error"]["type"] == "queue_full", full.body
            assert first.result(timeout=30).status == 200
        assert metric(port, "mmenc_batch_images_count") == 1 and metric(port, "mmenc_batch_images_sum") == 4

        # a client that hangs up before its tower call: the front end cancels the engine's job
        hang_up_after(port, {"images": [data_url(png(84, 84, seed=80))]},
                      lambda: metric(port, "mmenc_cache_misses_total") == 5, "the image to reach the engine")
        wait_for(lambda: metric(port, "mmenc_cancelled_images_total") == 1, 10, "the dropped image to be counted")
        time.sleep(1.7)  # past max_wait_ms: a job still queued would have been run by now
        assert metric(port, "mmenc_batch_images_count") == 1, "the abandoned image still reached the tower"
        assert metric(port, "mmenc_in_flight_images") == 0 and metric(port, "mmenc_queue_depth") == 0

        # SIGKILL a front end: the engine restarts it; requests keep being answered
        killed = _frontends(proc.pid)[0]
        metrics_dir = _environ(killed)["PROMETHEUS_MULTIPROC_DIR"]
        os.kill(killed, signal.SIGKILL)
        wait_for(lambda: len(_frontends(proc.pid)) == 2 and killed not in _frontends(proc.pid), 30,
                 "the front end to be restarted")
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "the new front end to be ready")
        for i in range(4):
            reply = post_json(port, {"images": [data_url(png(56, 84, seed=90 + i))], "format": "base64"})
            assert reply.status == 200 and "embedding" in reply.json()["data"][0], reply.body[:300]

        # SIGTERM with a request waiting in the batcher (max_wait_ms): it is answered, then exit 0
        sigterm_with_one_request_in_flight(proc, port, png(56, 84, seed=3), hidden=24)
    log = open(tmp_path / "serve.log").read()
    assert "restarting it" in log and "Traceback" not in log, log[-3000:]
    with pytest.raises(OSError):
        request(port, "GET", "/health", timeout=2)
    assert not os.path.exists(metrics_dir), "the multiprocess metrics folder was left behind"


def test_frontends_exit_when_the_engine_dies(q25, tmp_path):
    port = free_port()
    args = ["--model", q25, "--device", "cpu", "--port", str(port), "--frontends", "1", "--preprocess-threads", "1"]
    with cli_server(args, port, tmp_path / "serve.log") as proc:
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "/health to turn 200")
        frontends = _frontends(proc.pid)
        assert len(frontends) == 1
        metrics_dir = _environ(frontends[0])["PROMETHEUS_MULTIPROC_DIR"]
        proc.kill()
        proc.wait()

        def gone() -> bool:
            return not os.path.exists(f"/proc/{frontends[0]}") or open(f"/proc/{frontends[0]}/stat").read().rsplit(
                ")", 1)[1].split()[0] == "Z"
        wait_for(gone, 30, "the front end to exit after its engine")
    with pytest.raises(OSError):
        request(port, "GET", "/health", timeout=2)
    assert not os.path.exists(metrics_dir), "the front end left the killed engine's metrics folder behind"


def test_channel_maps_a_segment_once_and_forgets_it_when_destroyed():
    import torch

    from mmenc.shm import Channel, SegmentPool, socket_pair

    a, b = socket_pair()
    sender, receiver = Channel(a), Channel(b)
    pool = SegmentPool(max_free_bytes=0)  # nothing kept: a segment given back is destroyed
    segment = pool.take(3000)
    assert segment.storage.nbytes() == 1 << 16  # the smallest size class
    for value in (1.0, 2.0):  # the same segment twice: its descriptor travels once, the receiver maps it once
        sent = segment.tensor((10, 7), torch.float32).fill_(value)
        sender.send(("answer", int(value)), [(segment, sent[2:5])])
        header, [(seg_id, got)] = receiver.recv()
        assert header == ("answer", int(value)) and seg_id == segment.id
        assert got.shape == (3, 7) and torch.equal(got, sent[2:5]) and got.untyped_storage().nbytes() == 1 << 16
    assert list(receiver._mapped) == [segment.id]
    got.fill_(5.0)  # the same pages: a write on one side is seen on the other
    assert float(sent[3, 0]) == 5.0
    assert pool.give_back(segment) is False
    sender.forget(segment)
    sender.send(("next", 0))
    assert receiver.recv() == (("next", 0), []) and receiver._mapped == {}
    sender.close()
    assert receiver.recv() is None


def test_shared_outputs_return_a_segment_once_the_engine_and_every_front_end_let_go():
    import gc

    import torch

    from mmenc.serving.frontends.outputs import Holdings, SharedOutputs
    from mmenc.shm import SegmentPool

    destroyed = []
    outputs = SharedOutputs(SegmentPool(max_free_bytes=1 << 16), on_destroy=destroyed.append)
    first = outputs.alloc((4, 8), torch.bfloat16)
    segment = outputs.segment_of(first)
    holdings = Holdings()
    for _ in range(2):  # sent to a front end twice (e.g. a cache hit)
        outputs.ref(segment)
        holdings.add(segment.id)
    del first
    gc.collect()
    assert segment.refs == 2 and outputs.pool._free_bytes == 0  # the front end still reads it
    assert holdings.remove(segment.id) and not holdings.remove(12345)
    outputs.unref(segment.id)
    for seg_id, count in holdings.drain().items():  # the front end died holding one
        outputs.unref(seg_id, count)
    assert segment.refs == 0 and outputs.pool._free_bytes == 1 << 16 and not destroyed
    again = outputs.alloc((2, 8), torch.bfloat16)
    assert outputs.segment_of(again) is segment  # reused, not a new shared block
    other = outputs.alloc((2, 8), torch.bfloat16)
    del again, other
    gc.collect()
    assert len(destroyed) == 1  # one kept for reuse (max_free_bytes), the other dropped: its peers forget it
