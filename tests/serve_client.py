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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def load_b64_tensor(text: str) -> torch.Tensor:
    """What vLLM does with an image_embeds entry: torch.load(..., weights_only=True) of the base64."""
    return torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)


def decode_item(item: dict, fmt: str) -> torch.Tensor:
    if fmt == "vllm":
        part = item["image_embeds"]
        assert part["type"] == "image_embeds" and part["uuid"] == item["uuid"], part.keys()
        grid = load_b64_tensor(part["image_embeds"]["image_grid_thw"])
        assert grid.dtype == torch.int64 and grid.tolist() == [item["grid_thw"]], grid
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
