"""The service's contract against hostile bodies (issue 28, items 13 and 14), over real HTTP on loopback:
every answer that is not a success is `{"error": {"type", "field", "message"}}` (malformed multipart, unknown
routes and methods included), /openapi.json describes the routes with typed models (the real answers
validate against them), /v1/models shows a served name, never the checkpoint's path; and a bounded
property-based fuzz (hypothesis) of the real server: no 5xx, the contract kept, the embedding unchanged."""
import json
import pathlib
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402
from serve_client import (data_url, decode_item, free_port, multipart, png, post_json, request,  # noqa: E402
                          running_server, wait_for)

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.serving.schema import EncodeResponse, ErrorResponse, ModelList  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402

FUZZ_SECONDS = 8.0  # the fuzz test's budget on top of the server it shares


@pytest.fixture(scope="module")
def server(q25):
    settings = ServeSettings(port=free_port(), max_wait_ms=5, max_image_pixels=200 * 200, max_request_bytes=1 << 20,
                             max_images_per_request=4, preprocess_threads=1)
    with running_server(settings, lambda: Encoder(q25, device="cpu")) as (port, _):
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "the encoder to load")
        yield port


def assert_contract(reply, where: str) -> dict:
    """The error contract, or a 200 that validates as the route's typed answer; never a 5xx."""
    assert reply.status < 500, f"{where}: {reply.status} {reply.body[:300]!r}"
    body = json.loads(reply.body)
    if reply.status == 200:
        return body
    ErrorResponse.model_validate(body)
    error = body["error"]
    assert set(body) == {"error"} and all(isinstance(error[k], str) and error[k] for k in ("type", "field", "message"))
    assert " object at 0x" not in error["message"], error  # no object reprs (<_io.BytesIO object at 0x...>)
    return body


@pytest.mark.parametrize("body, content_type, field", [
    (b"--x\r\nContent-Disposition: form-data; name=a\r\n\r\n1\r\n--x--\r\n", "multipart/form-data", "body"),  # no boundary
    (b"this is not multipart at all", "multipart/form-data; boundary=abc", "body"),
    (b"--abc\r\nContent-Disposition: form-data; name=\"f\"; filename=\"a\"\r\n\r\nxyz",
     "multipart/form-data; boundary=abc", "images"),  # cut short: no part completes
    (b"--abc\r\nno headers here\r\n\r\nx\r\n--abc--\r\n", "multipart/form-data; boundary=abc", "body"),
    (b"--abc\r\nContent-Disposition: form-data\r\n\r\nx\r\n--abc--\r\n", "multipart/form-data; boundary=abc", "body"),
])
def test_malformed_multipart_keeps_the_error_contract(server, body, content_type, field):
    reply = request(server, "POST", "/v1/encode", body, {"content-type": content_type})
    error = assert_contract(reply, "multipart")["error"]
    assert reply.status == 400 and error["field"] == field, error


@pytest.mark.parametrize("method, path, status, kind", [
    ("GET", "/nope", 404, "not_found"), ("POST", "/v1/models", 405, "method_not_allowed"),
    ("GET", "/v1/encode", 405, "method_not_allowed"), ("DELETE", "/health", 405, "method_not_allowed")])
def test_unknown_routes_and_methods_keep_the_error_contract(server, method, path, status, kind):
    reply = request(server, method, path)
    assert reply.status == status and assert_contract(reply, path)["error"]["type"] == kind


def test_openapi_describes_the_routes_with_typed_models(server, q25):
    doc = request(server, "GET", "/openapi.json").json()
    encode = doc["paths"]["/v1/encode"]["post"]
    content = encode["requestBody"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/EncodeJsonRequest"}
    assert "multipart/form-data" in content
    assert encode["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/EncodeResponse")
    assert encode["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    schemas = doc["components"]["schemas"]
    refs = {ref.rsplit("/", 1)[-1] for ref in _refs(doc)}
    assert refs <= set(schemas), f"dangling $refs: {refs - set(schemas)}"
    assert schemas["EncodeJsonRequest"]["properties"]["format"]["enum"] == ["vllm", "base64", "json"]
    # the real answers are what the schema says
    models = ModelList.model_validate(request(server, "GET", "/v1/models").json())
    assert models.data[0].id == pathlib.Path(q25).name and models.data[0].weights == "checkpoint"
    for fmt in ("vllm", "base64", "json"):
        EncodeResponse.model_validate(post_json(server, {"images": [data_url(png(40, 50))], "format": fmt}).json())


def _refs(node):
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref":
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_models_shows_the_served_name_not_the_path(q25):
    settings = ServeSettings(port=free_port(), preprocess_threads=1, served_model_name="team/encoder")
    with running_server(settings, lambda: Encoder(q25, device="cpu")) as (port, _):
        wait_for(lambda: request(port, "GET", "/health").status == 200, 60, "the encoder to load")
        card = request(port, "GET", "/v1/models").json()["data"][0]
        assert card["id"] == "team/encoder" and q25 not in json.dumps(card)
        assert post_json(port, {"images": [data_url(png(30, 30))]}).json()["model"] == "team/encoder"
    with running_server(ServeSettings(port=free_port(), preprocess_threads=1),
                        lambda: Encoder("Qwen/Qwen2.5-VL-3B-Instruct", load_format="dummy", device="cpu",
                                        dtype="bfloat16")) as (port, _):
        wait_for(lambda: request(port, "GET", "/health").status == 200, 120, "the encoder to load")
        card = request(port, "GET", "/v1/models").json()["data"][0]
        assert card["id"] == "Qwen/Qwen2.5-VL-3B-Instruct" and card["weights"] == "random"


# -- the fuzz ---------------------------------------------------------------------------------------

_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                     max_leaves=12)
_image = st.sampled_from([png(20, 30), png(200, 201), b"\x89PNG\r\n\x1a\n" + b"\0" * 30, b"GIF89a" + b"\xff" * 20,
                          b"\xff\xd8\xff\xe0" + b"junk" * 10, b""])
_entry = st.one_of(_image.map(data_url), _image.map(lambda d: {"data": data_url(d).split(",", 1)[1]}), _json,
                   st.text(max_size=40).map(lambda t: "data:image/png;base64," + t))
_documents = st.one_of(_json, st.fixed_dictionaries({"images": st.lists(_entry, max_size=5)},
                                                    optional={"format": st.sampled_from(["vllm", "json", "x", 3]),
                                                              "uuids": _json, "fps": _json, "num_frames": _json}))
_types = st.sampled_from(["application/json", "multipart/form-data", "multipart/form-data; boundary=zz",
                          "text/plain", "image/png", "application/octet-stream", "", "application/json; charset=latin-1"])


@st.composite
def _bodies(draw):
    kind = draw(st.sampled_from(["json", "raw", "multipart", "cut-multipart"]))
    if kind == "json":
        return json.dumps(draw(_documents)).encode(), "application/json"
    if kind == "raw":
        return draw(st.binary(max_size=200)), draw(_types)
    body, content_type = multipart(draw(st.lists(_image, min_size=0, max_size=3)),
                                   draw(st.dictionaries(st.sampled_from(["format", "uuids", "fps", "x"]),
                                                        st.text(max_size=10), max_size=2)))
    if kind == "cut-multipart":
        cut = draw(st.integers(0, len(body)))
        body = body[:cut] + draw(st.binary(max_size=20))
    return body, content_type


def test_fuzzed_bodies_keep_the_contract_and_the_embedding(server):
    image = png(48, 64, seed=5)
    before = decode_item(post_json(server, {"images": [data_url(image)], "format": "json"}).json()["data"][0], "json")
    deadline = time.monotonic() + FUZZ_SECONDS

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(_bodies())
    def one(case):
        if time.monotonic() > deadline:
            return  # the budget is spent: the remaining examples pass at once
        body, content_type = case
        reply = request(server, "POST", "/v1/encode", body, {"content-type": content_type} if content_type else {})
        answer = assert_contract(reply, f"{content_type} {body[:80]!r}")
        if reply.status == 200:
            for item in EncodeResponse.model_validate(answer).data:
                assert item.error is None or (item.error.type and " object at 0x" not in item.error.message), item

    one()
    after = decode_item(post_json(server, {"images": [data_url(image)], "format": "json"}).json()["data"][0], "json")
    assert torch.equal(before, after)


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height (grayscale) and whose pixel data is empty."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_bombs_and_garbage_are_named_with_sizes_not_reprs(server):
    """Over PIL's own hard limit (twice Image.MAX_IMAGE_PIXELS) a bomb is `image_too_large` as one under it
    but over max_image_pixels is; garbage is `invalid_image` without a Python repr; sizes are width=/height=."""
    images = [_png_header(20000, 20000), _png_header(300, 250), b"not an image at all", png(20, 20)]
    data = post_json(server, {"images": [data_url(d) for d in images], "format": "json"}).json()["data"]
    assert [item.get("error", {}).get("type") for item in data] == ["image_too_large", "image_too_large",
                                                                    "invalid_image", None]
    assert "pixels" in data[0]["error"]["message"] and "max_image_pixels" in data[0]["error"]["message"]
    assert "width=300 height=250 = 75000 pixels" in data[1]["error"]["message"]
    assert "object at 0x" not in data[2]["error"]["message"] and "PIL cannot identify" in data[2]["error"]["message"]
