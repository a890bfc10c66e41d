"""POST /v1/embeddings (issue 31, item 4) spoken to by the official `openai` client over real HTTP on
loopback, with tiny random-weight CLIP and SigLIP checkpoints saved by transformers (and their tiny
tokenizers): texts, data-URL images and lists of both equal Encoder offline (L2-normalised) to float32
precision, in one process and through `--frontends 2`; base64 decoded by hand; `normalize: false`;
vLLM's `messages` form; Infinity's `modality`; `dimensions`; the cache; errors in the service's
contract. /v1/encode's pooled answers too."""
import base64
import json

import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import serve_client  # noqa: E402
from serve_client import data_url, free_port, metric, png, post_json, rel_err, request, served  # noqa: E402

from mmenc.engine.encoder import Encoder  # noqa: E402
from mmenc.serving.embeddings import check_model, parse_embeddings  # noqa: E402
from mmenc.serving.engine_client import EngineInfo  # noqa: E402
from mmenc.serving.inputs import RequestError  # noqa: E402
from mmenc.serving.settings import ServeSettings  # noqa: E402
from mmenc.testing import checkpoints as ck  # noqa: E402

KEY = "embed-key"
TEXTS = ["a photo of a cat", "two dogs on the grass", "the red car"]
TOL = 1e-5


def _save(kind: str, folder):
    if kind == "clip":
        path, _ = ck.save_clip(folder)
        ck.save_tiny_tokenizer(path, "clip")
    else:
        path, _ = ck.save_siglip(folder, version=1)
        ck.save_tiny_tokenizer(path, "siglip")
    return str(path)


@pytest.fixture(scope="module", params=[("clip", 0), ("siglip", 2)], ids=["clip-one-process", "siglip-frontends-2"])
def server(request, tmp_path_factory):
    """(port, checkpoint, Encoder on the CPU) for CLIP in one process and SigLIP as `mmenc serve --frontends 2`."""
    kind, frontends = request.param
    folder = _save(kind, tmp_path_factory.mktemp(kind))
    settings = ServeSettings(port=free_port(), api_key=KEY, max_wait_ms=10, preprocess_threads=2,
                             max_images_per_request=8, frontends=frontends)
    log = tmp_path_factory.mktemp("log") / "serve.log"
    with Encoder(folder, device="cpu") as enc, served(settings, folder, log) as port:
        card = serve_client.request(port, "GET", "/v1/models", headers={"authorization": f"Bearer {KEY}"}).json()
        yield port, card["data"][0]["id"], enc  # the served name (the folder's name)


def _client(port: int, key: str = KEY):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=60)


def _unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x.float(), dim=-1)


def _post(port, doc, key=KEY):
    return request(port, "POST", "/v1/embeddings", json.dumps(doc).encode(),
                   {"content-type": "application/json", "authorization": f"Bearer {key}"})


def test_openai_client_texts_images_and_a_mixed_list(server):
    port, name, enc = server
    images = [png(40, 56, seed=1), png(64, 48, seed=2)]
    want_images = _unit(torch.stack(enc.encode(images, pooled=True)))
    want_texts = _unit(enc.embed_text(TEXTS))
    client = _client(port)
    for fmt in ("base64", "float"):  # the client asks base64 by default and decodes it itself
        kwargs = {} if fmt == "base64" else {"encoding_format": "float"}
        mixed = [TEXTS[0], data_url(images[0]), TEXTS[1], data_url(images[1]), TEXTS[2]]
        got = client.embeddings.create(model=name, input=mixed, **kwargs)
        assert [d.index for d in got.data] == list(range(5)) and got.model == name
        vectors = torch.tensor([d.embedding for d in got.data])
        want = torch.stack([want_texts[0], want_images[0], want_texts[1], want_images[1], want_texts[2]])
        assert vectors.shape == want.shape == (5, enc.pooled_dim)
        err = rel_err(vectors, want)
        assert err < TOL, f"{fmt}: served embeddings differ from Encoder offline by {err:.2e}"
        assert torch.allclose(vectors.norm(dim=-1), torch.ones(5), atol=1e-6)
        patches = [int(np.prod(g)) for g in enc.preprocess(images)[1].tolist()]
        assert got.usage.prompt_tokens == sum(enc.text_tokens(TEXTS)) + sum(patches) == got.usage.total_tokens
    one = client.embeddings.create(model=name, input=TEXTS[0])  # a single string
    assert rel_err(torch.tensor(one.data[0].embedding), want_texts[0]) < TOL


def test_base64_by_hand_and_normalize_false(server):
    port, name, enc = server
    image = png(48, 48, seed=3)
    reply = _post(port, {"model": name, "input": [data_url(image), TEXTS[2]], "encoding_format": "base64",
                         "normalize": False})
    assert reply.status == 200, reply.body[:300]
    body = reply.json()
    assert body["object"] == "list" and body["data"][0]["object"] == "embedding"
    got = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    raw_image, raw_text = enc.encode([image], pooled=True)[0], enc.embed_text([TEXTS[2]])[0]
    assert rel_err(torch.from_numpy(got[0].copy()), raw_image) < TOL
    assert rel_err(torch.from_numpy(got[1].copy()), raw_text) < TOL
    assert abs(float(np.linalg.norm(got[0])) - 1.0) > 1e-3, "normalize=false must return the raw vector"


def test_vllm_messages_form_and_infinity_modality(server):
    port, name, enc = server
    image = png(56, 40, seed=4)
    parts = {"type": "image_url", "image_url": {"url": data_url(image)}}
    got = _post(port, {"model": name, "messages": [{"role": "user", "content": [parts]}]}).json()["data"]
    want = _unit(enc.encode([image], pooled=True)[0])
    assert len(got) == 1 and rel_err(torch.tensor(got[0]["embedding"]), want) < TOL
    text = _post(port, {"messages": [{"role": "user", "content": TEXTS[1]}]}).json()["data"][0]["embedding"]
    assert rel_err(torch.tensor(text), _unit(enc.embed_text([TEXTS[1]])[0])) < TOL
    both = _post(port, {"messages": [{"role": "user", "content": [parts, {"type": "text", "text": "a"}]}]})
    assert both.status == 400 and both.json()["error"]["field"] == "messages"
    assert "2 content parts" in both.json()["error"]["message"]
    # Infinity's modality field: every string is read as it says
    as_image = _post(port, {"input": [data_url(image)], "modality": "image"}).json()["data"][0]["embedding"]
    assert rel_err(torch.tensor(as_image), torch.tensor(got[0]["embedding"])) < TOL
    refused = _post(port, {"input": ["a photo"], "modality": "image"})
    assert refused.status == 400 and refused.json()["error"]["field"] == "input[0]"
    assert refused.json()["error"]["type"] == "unsupported_input"


def test_repeats_hit_the_cache(server):
    port, name, enc = server
    image = data_url(png(44, 44, seed=5))
    hits = metric(port, "mmenc_cache_hits_total")
    first = _post(port, {"input": [image, "a red house"]}).json()["data"]
    again = _post(port, {"input": [image, "a red house"]}).json()["data"]
    assert first == again
    assert metric(port, "mmenc_cache_hits_total") >= hits + 2, "the image and the text were not answered from the cache"
    assert metric(port, "mmenc_texts_total") >= 2
    assert metric(port, 'mmenc_requests_total{route="/v1/embeddings",status="200"}') >= 2


@pytest.mark.parametrize("doc, status, field, kind", [
    ({"model": "other-model", "input": ["a"]}, 404, "model", "model_not_found"),
    ({"input": ["a"], "dimensions": 7}, 400, "dimensions", "unsupported_dimensions"),
    ({"input": []}, 400, "input", "invalid_request"),
    ({"input": [[1, 2, 3]]}, 400, "input", "invalid_request"),
    ({"input": ["a"], "encoding_format": "npy"}, 400, "encoding_format", "invalid_request"),
    ({"input": ["a"], "colour": 1}, 400, "colour", "invalid_request"),
    ({"input": ["a"], "messages": [{"content": "b"}]}, 400, "input", "invalid_request"),
    ({"input": ["a", "data:image/png;base64,@@@"]}, 400, "input[1]", "invalid_base64"),
    ({"input": ["data:image/png;base64,bm90IGFuIGltYWdl"]}, 400, "input[0]", "invalid_image"),
    ({"input": ["a"] * 9}, 400, "input", "too_many_images"),
])
def test_errors_name_the_field(server, doc, status, field, kind):
    reply = _post(server[0], doc)
    assert reply.status == status, (reply.status, reply.body[:300])
    error = reply.json()["error"]
    assert (error["field"], error["type"]) == (field, kind), error
    assert field.split("[")[0].split(".")[0] in error["message"], error


def test_openai_client_errors(server):
    port, name, _ = server
    with pytest.raises(openai.AuthenticationError):
        _client(port, key="wrong").embeddings.create(model=name, input=["a"])
    with pytest.raises(openai.BadRequestError, match="not a matryoshka model"):
        _client(port).embeddings.create(model=name, input=["a"], dimensions=3)
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        _client(port).embeddings.create(model="text-embedding-3-small", input=["a"])
    full = _client(port).embeddings.create(model=name, input=["a"], dimensions=server[2].pooled_dim)
    assert len(full.data[0].embedding) == server[2].pooled_dim


def test_encode_route_pooled_answers(server):
    port, name, enc = server
    images = [png(40, 40, seed=6), png(56, 48, seed=7)]
    reply = post_json(port, {"images": [data_url(d) for d in images], "pooled": True}, key=KEY)
    assert reply.status == 200, reply.body[:300]
    want = enc.encode(images, pooled=True)
    for item, w in zip(reply.json()["data"], want):
        assert item["shape"] == [1, enc.pooled_dim] and item["num_tokens"] == 1 and item["dtype"] == "float32"
        got = torch.frombuffer(bytearray(base64.b64decode(item["embedding"])), dtype=torch.float32)
        assert rel_err(got, w) < TOL
    as_json = post_json(port, {"images": [data_url(images[0])], "pooled": True, "format": "json"}, key=KEY).json()
    assert rel_err(torch.tensor(as_json["data"][0]["embedding"][0]), want[0]) < TOL
    refused = post_json(port, {"images": [data_url(images[0])], "pooled": True, "format": "vllm"}, key=KEY)
    assert refused.status == 400 and refused.json()["error"]["field"] == "format"
    rows = post_json(port, {"images": [data_url(images[0])], "format": "base64"}, key=KEY).json()["data"][0]
    assert rows["num_tokens"] == enc.output_tokens(enc.preprocess(images[:1])[1])[0], "pooled answers left rows behind"


def test_vlm_tower_is_refused_clearly(tmp_path, q25):
    settings = ServeSettings(port=free_port(), max_wait_ms=5, preprocess_threads=2)
    with served(settings, q25, tmp_path / "s.log") as port:
        reply = _post(port, {"input": [data_url(png(56, 56))]})
        assert reply.status == 400 and reply.json()["error"]["type"] == "unsupported_model"
        assert "no pooled image embedding" in reply.json()["error"]["message"]
        text = _post(port, {"input": ["a cat"]})
        assert text.status == 400 and "no text tower" in text.json()["error"]["message"]
        pooled = post_json(port, {"images": [data_url(png(56, 56))], "pooled": True})
        assert pooled.status == 400 and pooled.json()["error"]["field"] == "pooled"
        card = request(port, "GET", "/v1/models").json()["data"][0]
        assert card["pooled_dim"] is None and card["text"] is False


def _info(matryoshka) -> EngineInfo:
    return EngineInfo(model_name="m", card={}, identity=b"", processor=None, uint8=False, dtype=torch.float32,
                      pooled_dim=32, text_error=None, matryoshka=matryoshka)


def test_dimensions_follow_the_checkpoints_matryoshka_config():
    parsed = parse_embeddings(json.dumps({"input": ["a"], "dimensions": 16}).encode(), 8)
    assert check_model(parsed, _info((8, 16))) == 16
    assert check_model(parsed, _info(True)) == 16
    with pytest.raises(RequestError, match="trained to be cut to 8, 24"):
        check_model(parsed, _info((8, 24)))
    with pytest.raises(RequestError, match="not a matryoshka model"):
        check_model(parsed, _info(()))
    wider = parse_embeddings(json.dumps({"input": ["a"], "dimensions": 64}).encode(), 8)
    with pytest.raises(RequestError, match="gives 32-wide vectors"):
        check_model(wider, _info(True))


def test_batcher_mixes_pooled_and_row_jobs_in_one_call(tmp_path):
    """One tower call over a pooled job and a rows job: each gets its own kind of answer."""
    from mmenc.serving.batcher import Job
    from mmenc.serving.launch import make_batcher
    from mmenc.serving.metrics import ServeMetrics

    folder = _save("clip", tmp_path)
    images = [png(40, 40, seed=8), png(48, 56, seed=9), png(56, 40, seed=10)]
    with Encoder(folder, device="cpu") as enc:
        settings = ServeSettings(max_wait_ms=200)  # the three jobs land in one call
        batcher = make_batcher(enc, settings, ServeMetrics())
        jobs = []
        for data, pooled in zip(images, (True, False, True)):
            pixel_values, grid = enc.preprocess([data])
            jobs.append(Job(pixel_values, grid, pooled=pooled))
        futures = [batcher.submit(job) for job in jobs]
        answers = [f.result(timeout=60) for f in futures]
        batcher.close()
        pooled, rows = enc.encode(images, pooled=True), enc.encode(images)
    assert [a.full.shape[0] for a in answers] == [1, rows[1].shape[0], 1]
    assert rel_err(answers[0].full[0], pooled[0]) < TOL and rel_err(answers[2].full[0], pooled[2]) < TOL
    assert rel_err(answers[1].full, rows[1]) < TOL and answers[1].hidden == rows[1].shape[1]
    assert answers[0].hidden == enc.pooled_dim


def test_render_cuts_then_normalises_and_fails_on_the_first_bad_input():
    """A matryoshka width: the first `dimensions` values, then L2-normalised; base64 is little-endian float32."""
    from mmenc.serving.formats import EncodedImage
    from mmenc.serving.inputs import ItemError
    from mmenc.serving.embeddings import render
    from mmenc.serving.metrics import ServeMetrics
    from mmenc.serving.service import Item

    doc = {"input": ["a", "b"], "dimensions": 16, "encoding_format": "base64"}
    parsed = parse_embeddings(json.dumps(doc).encode(), 8)
    info = _info((16,))
    width = check_model(parsed, info)
    vectors = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    items = [Item(key="k", image=EncodedImage(v[None].to(torch.bfloat16), 32, (1, 1, 3))) for v in vectors]
    body = json.loads(b"".join(render(parsed, width, info, ServeMetrics(), parsed.request, items)))
    for got, v in zip(body["data"], vectors):
        decoded = torch.from_numpy(np.frombuffer(base64.b64decode(got["embedding"]), dtype="<f4").copy())
        assert decoded.shape == (16,)
        assert torch.allclose(decoded, _unit(v.to(torch.bfloat16).float()[:16]), atol=1e-6)
    assert body["usage"] == {"prompt_tokens": 6, "total_tokens": 6}
    items[1] = Item(error=ItemError("invalid_image", "images[1]: not a decodable image"))
    with pytest.raises(RequestError, match=r"input\[1\]: not a decodable image") as e:
        render(parsed, width, info, ServeMetrics(), parsed.request, items)
    assert (e.value.status, e.value.field, e.value.kind) == (400, "input[1]", "invalid_image")
