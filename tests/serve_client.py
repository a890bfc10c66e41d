"""Helpers for the `mmenc serve` tests: a server in a thread on a free loopback port, a small HTTP
client (stdlib only), image and multipart builders, and the decoders a vLLM client would use."""
import base64
import contextlib
import http.client
import io
import json
import re
import socket
import threading
import time
import uuid as uuidlib

import numpy as np
import torch
from PIL import Image

from mmenc.testing.processes import child_pids, free_port  # noqa: F401  (the serve tests import them from here)


def png(h: int, w: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Reply:
    def __init__(self, status: int, headers: dict, body: bytes):
        self.status, self.headers, self.body = status, headers, body

    def json(self):
        return json.loads(self.body)


def request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
            timeout: float = 60.0) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def post_json(port: int, doc, key: str | None = None, timeout: float = 60.0) -> Reply:
    headers = {"content-type": "application/json"}
    if key:
        headers["authorization"] = f"Bearer {key}"
    return request(port, "POST", "/v1/encode", json.dumps(doc).encode(), headers, timeout)


def multipart(files: list[bytes], fields: dict[str, str]) -> tuple[bytes, str]:
    boundary = uuidlib.uuid4().hex
    out = io.BytesIO()
    for name, value in fields.items():
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for i, data in enumerate(files):
        out.write(f'--{boundary}\r\nContent-Disposition: form-data; name="images"; filename="{i}.png"\r\n'
                  f'Content-Type: image/png\r\n\r\n'.encode() + data + b"\r\n")
    out.write(f"--{boundary}--\r\n".encode())
    return out.getvalue(), f"multipart/form-data; boundary={boundary}"


def metric(port: int, name: str) -> float:
    """The value of one sample of /metrics (0 when absent), e.g. metric(p, 'mmenc_images_total')."""
    text = request(port, "GET", "/metrics").body.decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def hang_up_after(port: int, doc, reached, what: str) -> None:
    """POST `doc` to /v1/encode on a raw connection, wait until `reached()` (the image got to the
    server), then close the connection without reading the answer: a client that left."""
    body = json.dumps(doc).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    wait_for(reached, 10, what)
    sock.close()


def sigterm_with_one_request_in_flight(proc, port: int, image: bytes, hidden: int) -> None:
    """SIGTERM the server `proc` while one request waits in its batcher: that request is still
    answered (200, its embedding whole), then the process exits 0."""
    import concurrent.futures
    import signal

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post_json, port, {"images": [data_url(image)], "format": "base64"})
        wait_for(lambda: metric(port, "mmenc_in_flight_images") == 1, 10, "the request to be in flight")
        proc.send_signal(signal.SIGTERM)
        reply = pending.result(timeout=30)
    assert reply.status == 200, reply.body[:300]
    item = reply.json()["data"][0]
    assert decode_item(item, "base64").shape == (item["num_tokens"], hidden)
    assert proc.wait(timeout=60) == 0


def load_b64_tensor(text: str) -> torch.Tensor:
    """What vLLM does with an image_embeds entry: torch.load(..., weights_only=True) of the base64."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def decode_item(item: dict, fmt: str) -> torch.Tensor:
    if fmt == "vllm":
        part = item["image_embeds"]
        assert part["type"] == "image_embeds" and part["uuid"] == item["uuid"], part.keys()
        grid = load_b64_tensor(part["image_embeds"]["image_grid_thw"])
        assert grid.dtype == torch.int64 and grid.tolist() == item["grid_thw"], grid
        return load_b64_tensor(part["image_embeds"]["image_embeds"])
    if fmt == "base64":
        raw = bytearray(base64.b64decode(item["embedding"]))
        dtype = getattr(torch, item["dtype"])
        return torch.frombuffer(raw, dtype=dtype).reshape(item["shape"])
    return torch.tensor(item["embedding"], dtype=torch.float32)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


@contextlib.contextmanager
def running_server(settings, make_encoder):
    """build_server(...) run in a thread; yields (port, service); stops it (graceful) on exit."""
    from mmenc.serving.server import build_server

    server, service = build_server(settings, make_encoder, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, 30, "uvicorn to start")
        yield settings.port, service
    finally:
        server.should_exit = True
        thread.join(30)


def serve_flags(settings) -> list[str]:
    """`mmenc serve` flags giving `settings` (a ServeSettings)."""
    flags = ["--host", settings.host, "--port", str(settings.port),
             "--max-batch-patches", str(settings.max_batch_patches),
             "--max-wait-ms", str(settings.max_wait_ms), "--cache-bytes", str(settings.cache_bytes),
             "--max-request-bytes", str(settings.max_request_bytes),
             "--max-images-per-request", str(settings.max_images_per_request),
             "--max-image-pixels", str(settings.max_image_pixels), "--max-queue-images", str(settings.max_queue_images),
             "--preprocess-threads", str(settings.preprocess_threads),
             "--shutdown-timeout", str(settings.shutdown_timeout_s), "--max-in-flight", str(settings.max_in_flight),
             "--bucket-batches", settings.bucket_batches, "--frontends", str(settings.frontends)]
    flags += ["--api-key", settings.api_key] if settings.api_key else []
    flags += ["--ec-storage", settings.ec_storage] if settings.ec_storage else []
    return flags


@contextlib.contextmanager
def cli_server(args: list[str], port: int, log_path, timeout: float = 90.0, script: str | None = None):
    """`mmenc serve ARGS` (or `python SCRIPT ARGS`) as a subprocess; yields the Popen once it
    listens (not necessarily ready); SIGTERM and a wait for its exit at the end (killed if it hangs)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [root, os.environ.get("PYTHONPATH")] if p))
    cmd = [sys.executable, script] if script else [sys.executable, "-m", "mmenc.cli.main", "serve"]
    log = open(log_path, "w+")
    proc = subprocess.Popen(cmd + args, stdout=log, stderr=subprocess.STDOUT, env=env)

    def listening() -> bool:
        assert proc.poll() is None, f"server exited early ({proc.returncode}): {open(log_path).read()[-3000:]}"
        try:
            request(port, "GET", "/health", timeout=2)
            return True
        except OSError:
            return False

    try:
        wait_for(listening, timeout, "the server to listen")
        yield proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


@contextlib.contextmanager
def served(settings, model: str, log_path, dtype: str | None = None):
    """A server for `settings` over the checkpoint `model` on the CPU, ready: in a thread of this
    process (settings.frontends == 0), else the `mmenc serve` command with its front ends. Yields the port."""
    if settings.frontends == 0:
        from mmenc.engine.encoder import Encoder

        kwargs = {"dtype": dtype} if dtype else {}
        with running_server(settings, lambda: Encoder(model, device="cpu", **kwargs)) as (port, service):
            wait_for(lambda: service.state == "ready", 60, "the encoder to load")
            yield port
        return
    args = serve_flags(settings) + ["--model", model, "--device", "cpu"] + (["--dtype", dtype] if dtype else [])
    with cli_server(args, settings.port, log_path) as proc:
        wait_for(lambda: request(settings.port, "GET", "/health").status == 200, 90, "/health to turn 200")
        yield settings.port
        proc.terminate()
        assert proc.wait(60) == 0, f"mmenc serve exited with {proc.returncode}: {open(log_path).read()[-3000:]}"
