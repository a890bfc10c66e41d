"""`mmenc serve` over real HTTP on loopback, with tiny random-weight checkpoints (CPU, fp32): every
format decoded as vLLM would equals Encoder.encode, multipart, uuids and the cache, vLLM's EC files,
auth, bad inputs, limits, concurrent clients."""
import concurrent.futures
import json
import threading

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from mmenc.testing.checkpoints import save_qwen3_vl  # noqa: E402
from serve_client import (  # noqa: E402
    data_url,
    decode_item,
    free_port,
    hang_up_after,
    metric,
    multipart,
    png,
    post_json,
    rel_err,
    request,
    running_server,
    served,
)

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402

KEY = "test-key"
SIZES = [(56, 84), (112, 56), (60, 61)]


@pytest.fixture(scope="module", params=[0, 2], ids=["one-process", "frontends-2"])
def server(q25, request, tmp_path_factory):
    """The main server: API key, small pixel and request limits the bad-input tests hit; in one
    process, and as the `mmenc serve --frontends 2` command (the same contract)."""
    settings = ServeSettings(port=free_port(), api_key=KEY, max_wait_ms=20, max_image_pixels=250 * 250,
                             max_request_bytes=2 << 20, max_images_per_request=8, preprocess_threads=2,
                             frontends=request.param)
    with served(settings, q25, tmp_path_factory.mktemp("serve_log") / "serve.log") as port:
        yield port


def _encode(port, images, fmt="vllm", uuids=None):
    doc = {"images": [data_url(d) for d in images], "format": fmt, **({"uuids": uuids} if uuids else {})}
    reply = post_json(port, doc, key=KEY)
    assert reply.status == 200, reply.body[:500]
    return reply.json()


def test_health_models_metrics(server):
    assert request(server, "GET", "/health").json() == {"status": "ok"}
    card = request(server, "GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()["data"][0]
    assert card["architecture"] == "Qwen2_5_VLForConditionalGeneration" and card["hidden_size"] == 24
    assert card["dtype"] == "float32", card
    text = request(server, "GET", "/metrics").body.decode()
    for name in ("mmenc_requests_total", "mmenc_queue_depth", "mmenc_tower_seconds_bucket", "mmenc_cache_hits_total",
                 "mmenc_preprocess_seconds_bucket", "mmenc_batch_images_bucket", "mmenc_cache_bytes"):
        assert name in text, f"{name} missing from /metrics"


@pytest.mark.parametrize("fmt", ["vllm", "base64", "json"])
def test_every_format_equals_encoder_encode(server, reference, fmt):
    images = [png(h, w, seed=10 + i) for i, (h, w) in enumerate(SIZES)]
    body = _encode(server, images, fmt)
    want = reference.encode(images)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert body["usage"] == {"images": 3, "tokens": sum(w.shape[0] for w in want)}
    for item, w, (_, grid) in zip(body["data"], want, [reference.preprocess([im]) for im in images]):
        got = decode_item(item, fmt)
        assert item["grid_thw"] == grid[0].tolist() and item["num_tokens"] == w.shape[0]
        assert got.shape == w.shape and got.dtype == (torch.float32 if fmt == "json" else w.dtype)
        assert rel_err(got, w) < 1e-5, f"{fmt}: served embedding differs from Encoder.encode by {rel_err(got, w):.2e}"


def test_multipart_gives_the_json_answer(server):
    images = [png(56, 56, seed=30), png(84, 56, seed=31)]
    body, ctype = multipart(images, {"format": "base64", "uuids": json.dumps(["mp-a", "mp-b"])})
    reply = request(server, "POST", "/v1/encode", body, {"content-type": ctype, "authorization": f"Bearer {KEY}"})
    assert reply.status == 200, reply.body[:300]
    got = reply.json()["data"]
    want = _encode(server, images, "base64")["data"]
    assert [g["uuid"] for g in got] == ["mp-a", "mp-b"]
    for g, w in zip(got, want):  # the same images, maybe batched differently: equal up to fp32 rounding
        assert rel_err(decode_item(g, "base64"), decode_item(w, "base64")) < 1e-5


def test_uuids_and_content_keys_hit_the_cache(server):
    image = png(70, 70, seed=40)
    hits = metric(server, "mmenc_cache_hits_total")
    first = _encode(server, [image], "base64", uuids=["cat-1"])["data"][0]
    again = _encode(server, [image], "base64", uuids=["cat-1"])["data"][0]
    assert (first["uuid"], first["cached"], again["cached"]) == ("cat-1", False, True)
    assert again["embedding"] == first["embedding"]
    plain = [_encode(server, [image], "base64")["data"][0] for _ in range(2)]
    assert plain[0]["uuid"] == plain[1]["uuid"] and len(plain[0]["uuid"]) == 64  # sha256 of model + bytes
    assert (plain[0]["cached"], plain[1]["cached"]) == (False, True)
    assert metric(server, "mmenc_cache_hits_total") == hits + 2
    assert metric(server, "mmenc_cache_bytes") > 0


def test_auth(server):
    doc = {"images": [data_url(png(56, 56))]}
    assert post_json(server, doc).status == 401
    reply = post_json(server, doc, key="wrong")
    assert reply.status == 401 and reply.json()["error"]["field"] == "authorization"
    assert request(server, "GET", "/v1/models").status == 401
    assert request(server, "GET", "/health").status == 200 and request(server, "GET", "/metrics").status == 200


@pytest.mark.parametrize("doc, field", [
    (b"{not json", "body"),
    ([1, 2], "body"),
    ({"images": "x"}, "images"),
    ({"images": []}, "images"),
    ({"images": ["data:image/png;base64,AAAA", 7]}, "images[1]"),
    ({"images": ["data:image/png;base64,AAAA"], "format": "npy"}, "format"),
    ({"images": ["data:image/png;base64,AAAA"], "uuids": ["a", "b"]}, "uuids"),
    ({"images": ["data:image/png;base64,AAAA"], "uuids": ["../etc"]}, "uuids[0]"),
    ({"images": ["data:image/png;base64,AAAA"] * 9}, "images"),
    ({"images": ["data:image/png;base64,AAAA"], "colour": 1}, "colour"),
])
def test_malformed_requests_are_400_naming_the_field(server, doc, field):
    body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    reply = request(server, "POST", "/v1/encode", body, {"content-type": "application/json",
                                                          "authorization": f"Bearer {KEY}"})
    assert reply.status == 400, (reply.status, reply.body)
    error = reply.json()["error"]
    assert error["field"] == field, error
    assert field.split("[")[0] in error["message"] or field == "body", error


def test_body_over_the_limit_is_413_and_wrong_type_415(server):
    big = {"images": [data_url(b"\0" * (3 << 20))]}
    assert post_json(server, big, key=KEY).status == 413
    reply = request(server, "POST", "/v1/encode", b"x", {"content-type": "text/plain", "authorization": f"Bearer {KEY}"})
    assert reply.status == 415 and "content-type" in reply.json()["error"]["message"]


def test_bad_images_fail_alone(server, reference):
    good = png(56, 56, seed=50)
    images = [data_url(good), "data:image/png;base64,@@@", {"data": "bm90IGFuIGltYWdl"}, "https://example.com/a.png",
              data_url(png(300, 300)), "data:image/png,rawbytes"]
    reply = post_json(server, {"images": images, "format": "base64"}, key=KEY)
    assert reply.status == 200, reply.body[:300]
    data = reply.json()["data"]
    kinds = [d.get("error", {}).get("type") for d in data]
    assert kinds == [None, "invalid_base64", "invalid_image", "unsupported_input", "image_too_large",
                     "invalid_data_url"], kinds
    assert "width=300 height=300" in data[4]["error"]["message"] and "max_image_pixels" in data[4]["error"]["message"]
    assert all(d["index"] == i for i, d in enumerate(data))
    assert rel_err(decode_item(data[0], "base64"), reference.encode([good])[0]) < 1e-5
    assert reply.json()["usage"]["images"] == 1


def test_sixteen_concurrent_clients_get_their_own_answers(server, reference):
    images = [png(28 * (2 + i % 3), 28 * (2 + i % 4), seed=100 + i) for i in range(32)]
    want = reference.encode(images)

    def client(c):
        mine = [2 * c, 2 * c + 1]
        body = _encode(server, [images[i] for i in mine], "base64", uuids=[f"conc-{i}" for i in mine])
        return [(i, decode_item(item, "base64"), item["uuid"]) for i, item in zip(mine, body["data"])]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = [r for rs in pool.map(client, range(16)) for r in rs]
    assert sorted(i for i, _, _ in results) == list(range(32))
    for i, got, uuid in results:
        assert uuid == f"conc-{i}"
        assert rel_err(got, want[i]) < 1e-5, f"image {i}: mismatch {rel_err(got, want[i]):.2e}"


@pytest.mark.parametrize("frontends", [0, 2], ids=["one-process", "frontends-2"])
def test_qwen3_deepstack_vllm_format_and_ec_storage(tmp_path, frontends):
    from safetensors.torch import load_file

    folder = str(save_qwen3_vl(tmp_path / "q3")[0])
    ref = Encoder(folder, device="cpu")
    images = [png(56, 84, seed=60), png(60, 61, seed=61)]
    want = [torch.cat([p.embeddings, *p.extras["deepstack"]], dim=1) for p in ref.encode(images, return_extras=True)]
    settings = ServeSettings(port=free_port(), ec_storage=str(tmp_path / "ec"), max_wait_ms=5, preprocess_threads=2,
                             frontends=frontends)
    with served(settings, folder, tmp_path / "serve.log") as port:
        card = request(port, "GET", "/v1/models").json()["data"][0]
        assert card["image_embeds_size"] == 3 * card["hidden_size"] and card["deepstack_levels"] == 2
        reply = post_json(port, {"images": [data_url(d) for d in images], "uuids": ["q3-a", None]})
        data = reply.json()["data"]
        base = post_json(port, {"images": [data_url(images[0])], "format": "base64"}).json()["data"][0]
    assert rel_err(decode_item(base, "base64"), ref.encode([images[0]])[0]) < 1e-5  # base64: main embeddings
    assert data[0]["uuid"] == "q3-a" and len(data[1]["uuid"]) == 64
    for item, w in zip(data, want):
        got = decode_item(item, "vllm")
        assert got.shape == w.shape and rel_err(got, w) < 1e-5, f"vllm image_embeds differ by {rel_err(got, w):.2e}"
        on_disk = load_file(str(tmp_path / "ec" / item["uuid"] / "encoder_cache.safetensors"))["ec_cache"]
        assert torch.equal(on_disk, got)
    assert not list((tmp_path / "ec").glob("*/.tmp-*")), "temporary files left in the EC storage"


def test_not_ready_then_queue_full_then_disconnect_frees_work(q25):
    """One slow-batching server: 503 while loading, a full queue answers 503 + Retry-After, a client
    that hangs up before its tower call has its image dropped, and four images share one tower call."""
    gate = threading.Event()

    def make():
        gate.wait(30)
        return Encoder(q25, device="cpu")

    settings = ServeSettings(port=free_port(), max_wait_ms=1500, max_queue_images=4, max_images_per_request=4,
                             cache_bytes=0, preprocess_threads=2)
    with running_server(settings, make) as (port, service):
        from serve_client import wait_for

        loading = request(port, "GET", "/health")
        assert loading.status == 503 and loading.json()["status"] == "loading"
        refused = post_json(port, {"images": [data_url(png(56, 56))]})
        assert refused.status == 503 and refused.headers["retry-after"] == "1"
        gate.set()
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "/health to turn 200")

        images = [png(56, 56, seed=70 + i) for i in range(4)]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            first = pool.submit(post_json, port, {"images": [data_url(d) for d in images]})
            wait_for(lambda: metric(port, "mmenc_in_flight_images") == 4, 10, "4 images in flight")
            full = post_json(port, {"images": [data_url(images[0])]})
            assert full.status == 503 and full.headers["retry-after"] == "1", full.body
            assert full.json()["error"]["type"] == "queue_full"
            assert first.result(timeout=30).status == 200
        assert metric(port, "mmenc_batch_images_count") == 1 and metric(port, "mmenc_batch_images_sum") == 4

        hang_up_after(port, {"images": [data_url(png(84, 84, seed=80))]},
                      lambda: metric(port, "mmenc_cache_misses_total") == 5, "the image to be preprocessed")
        wait_for(lambda: metric(port, "mmenc_cancelled_images_total") == 1, 10, "the dropped image to be counted")
        assert metric(port, "mmenc_batch_images_count") == 1, "the abandoned image still reached the tower"
        assert metric(port, "mmenc_in_flight_images") == 0


@pytest.mark.parametrize("frontends", [0, 2], ids=["one-process", "frontends-2"])
def test_bfloat16_tower_answers_in_its_dtype(q25, tmp_path, frontends):
    """The server casts pixels to the tower's dtype before batching (with front ends: in the front
    end, from the engine's ready info); answers equal Encoder.encode's."""
    ref = Encoder(q25, device="cpu", dtype="bfloat16")
    images = [png(56, 84, seed=90), png(60, 61, seed=91)]
    want = ref.encode(images)
    settings = ServeSettings(port=free_port(), max_wait_ms=50, preprocess_threads=2, frontends=frontends)
    with served(settings, q25, tmp_path / "serve.log", dtype="bfloat16") as port:
        assert request(port, "GET", "/v1/models").json()["data"][0]["dtype"] == "bfloat16"
        data = post_json(port, {"images": [data_url(d) for d in images], "format": "vllm"}).json()["data"]
    for item, w in zip(data, want):
        got = decode_item(item, "vllm")
        assert got.dtype == torch.bfloat16 and got.shape == w.shape
        assert rel_err(got, w) < 1e-2, f"bf16 served vs Encoder.encode: {rel_err(got, w):.2e} (tolerance 1e-2)"


def test_frontends_share_one_cache_and_sum_their_metrics(server, request):
    """With front ends: the same image on fresh connections until both front ends answered it; the
    engine's cache answers every repeat, whichever front end took it, and /metrics (from any front
    end) counts the requests of both."""
    if request.node.callspec.params["server"] == 0:
        pytest.skip("one process: no front ends")
    from serve_client import post_json as post

    doc = {"images": [data_url(png(63, 77, seed=140))], "format": "base64"}
    before = metric(server, 'mmenc_requests_total{route="/v1/encode",status="200"}')
    hits = metric(server, "mmenc_cache_hits_total")
    seen: dict[str, list[bool]] = {}
    for _ in range(60):  # each request on a new connection; the kernel picks the front end that accepts it
        reply = post(server, doc, key=KEY)
        assert reply.status == 200, reply.body[:300]
        seen.setdefault(reply.headers["x-mmenc-frontend"], []).append(reply.json()["data"][0]["cached"])
        if len(seen) == 2 and all(any(cs) for cs in seen.values()):
            break  # both front ends answered a repeat from the shared cache
    assert sorted(seen) == ["0", "1"], f"only front end(s) {sorted(seen)} answered 60 requests"
    answers = sum(map(len, seen.values()))
    assert sorted(c for cs in seen.values() for c in cs) == [False] + [True] * (answers - 1), seen
    assert all(any(cs) for cs in seen.values()), f"a front end never got a cache hit in 60 requests: {seen}"
    assert metric(server, "mmenc_cache_hits_total") == hits + answers - 1
    assert metric(server, 'mmenc_requests_total{route="/v1/encode",status="200"}') == before + answers
