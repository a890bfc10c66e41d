"""POST /v1/embeddings: the OpenAI embeddings API (what the `openai` client's `embeddings.create`,
vLLM's pooling runner and Infinity speak) over the same pipeline as /v1/encode: one pooled vector
per image (the tower's pooling head: CLIP's projected class token, SigLIP's attention pooling) and
per text (the checkpoint's text tower), L2-normalised unless `normalize` is false. docs/serving.md,
"POST /v1/embeddings", is the contract.

    {"model": M, "input": ["a photo of a cat", "data:image/jpeg;base64,..."], "encoding_format": "float"}
    {"model": M, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": ...}}]}]}

Inputs: a string is a text, unless it is a data URL (`data:...;base64,...`: an image) or `modality`
(Infinity's field) says "image" (every string an image) or "text" (every string a text). vLLM's
`messages` form is one input: exactly one content part (a text or an image_url). Any failed input
fails the request (400 naming `input[i]`): an OpenAI client reads `data` as one vector per input."""
import asyncio
import dataclasses
import functools
import time
from typing import Literal

import numpy as np
import pydantic
import torch
from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from mmenc.serving.b64 import b64encode
from mmenc.serving.formats import Body, dumps
from mmenc.serving.http import ClientGone, PiecesResponse, read_body, until_disconnect
from mmenc.serving.engine_client import EngineInfo
from mmenc.serving.inputs import EncodeRequest, ImageInput, RequestError, json_image
from mmenc.serving.schema import errors, request_body

EMBEDDINGS = "/v1/embeddings"


class ImageURL(BaseModel):
    url: str = Field(description="a data URL, data:image/<type>;base64,<data> (the service does not fetch URLs)")


class ContentPart(BaseModel):
    """A chat content part, as OpenAI's and vLLM's chat messages carry them."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageURL | str | None = None


class Message(BaseModel):
    role: str = "user"
    content: str | list[ContentPart]


class EmbeddingsRequest(BaseModel):
    """OpenAI's embeddings request; `messages` (vLLM), `normalize` (vLLM) and `modality` (Infinity) beside it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="the served model's id (GET /v1/models); omitted: that one")
    input: str | list[str] | None = Field(None, description="texts and data-URL images; one vector each")
    messages: list[Message] | None = Field(None, description="vLLM's chat form: one vector for one content part")
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="base64: the little-endian float32 bytes of each vector")
    dimensions: int | None = Field(None, ge=1, description="the vector width: the model's own, or one it was "
                                                           "trained to be cut to (matryoshka)")
    user: str | None = None
    normalize: bool = Field(True, description="false: the raw vectors, not L2-normalised")
    modality: Literal["text", "image"] | None = Field(None, description="read every string of `input` as this")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class Usage(BaseModel):
    prompt_tokens: int = Field(description="text tokens (no padding) plus image patches")
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: Usage


@dataclasses.dataclass(frozen=True)
class Parsed:
    """A request read: the service's EncodeRequest (images pooled) and how to answer it."""

    request: EncodeRequest
    model: str | None
    encoding_format: str
    dimensions: int | None
    normalize: bool
    field: str  # where the inputs came from: "input" or "messages"


def parse_embeddings(body: bytes, max_inputs: int) -> Parsed:
    """The JSON body -> Parsed, or RequestError 400 naming the field."""
    try:
        doc = EmbeddingsRequest.model_validate_json(body)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        field = _field(first["loc"])
        message = (INPUT_TYPES if field.split("[")[0] == "input" and first["type"].endswith("_type")
                   else f"{field}: {first['msg']}")
        raise RequestError(400, field, message) from e
    if (doc.input is None) == (doc.messages is None):
        raise RequestError(400, "input", "send exactly one of input (texts and data-URL images) and messages")
    if doc.messages is not None:
        items, field = [_message_input(doc.messages)], "messages"
    else:
        strings = [doc.input] if isinstance(doc.input, str) else doc.input
        items, field = [_string_input(s, i, doc.modality) for i, s in enumerate(strings)], "input"
    if not items:
        raise RequestError(400, "input", "input is empty; send at least one text or image")
    if len(items) > max_inputs:
        raise RequestError(400, "input", f"{len(items)} inputs in one request exceeds max_images_per_request="
                                         f"{max_inputs}; split the request", kind="too_many_images")
    return Parsed(EncodeRequest(items, "base64", pooled=True), doc.model, doc.encoding_format, doc.dimensions,
                  doc.normalize, field)


INPUT_TYPES = ("input must be a string or a list of strings: texts, and images as data URLs "
               "('data:image/png;base64,...'); token arrays are not accepted")
_TYPE_TAGS = {"str", "int", "bool", "float", "list", "dict"}


def _field(loc: tuple) -> str:
    """pydantic's error location -> the field as this API names it, e.g. ('messages', 0, 'content') ->
    'messages[0].content' (the union-branch tags pydantic puts in the location are left out)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or "-" in part:
            continue
        else:
            out += ("." if out else "") + part
    return out or "body"


def _string_input(text: str, index: int, modality: str | None) -> ImageInput:
    if modality == "text" or (modality is None and not text.startswith("data:")):
        return ImageInput(index, None, text=text)
    return json_image(text, index, None)


def _message_input(messages: list[Message]) -> ImageInput:
    parts = []
    for m in messages:
        parts += [ContentPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
    if len(parts) != 1:
        raise RequestError(400, "messages", f"messages hold {len(parts)} content parts; a contrastive model embeds "
                                            f"one text or one image per vector: send one part (several vectors: "
                                            f"a list in `input`)")
    part = parts[0]
    if part.type == "text":
        if part.text is None:
            raise RequestError(400, "messages", "a content part of type 'text' needs its `text`")
        return ImageInput(0, None, text=part.text)
    url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
    if url is None:
        raise RequestError(400, "messages", "a content part of type 'image_url' needs its `image_url.url`")
    return json_image(url, 0, None)


def check_model(parsed: Parsed, info: EngineInfo) -> int:
    """The output width; RequestError when the model, the inputs or `dimensions` do not fit the served model."""
    if parsed.model is not None and parsed.model != info.model_name:
        raise RequestError(404, "model", f"model={parsed.model!r} is not served here; this server serves "
                                         f"{info.model_name!r} (GET /v1/models)", kind="model_not_found")
    images = [item.index for item in parsed.request.images if item.text is None]
    if images and info.pooled_dim is None:
        raise RequestError(400, f"{parsed.field}[{images[0]}]" if parsed.field == "input" else parsed.field,
                           f"{info.model_name!r} is a VLM's tower: it has no pooled image embedding (no CLIP "
                           f"projection or SigLIP pooling head) to answer with one vector; /v1/embeddings serves "
                           f"CLIP, SigLIP and SigLIP2 checkpoints; POST /v1/encode returns this tower's token rows",
                           kind="unsupported_model")
    width = info.pooled_dim
    if width is None:  # texts only, and the service refuses them (no text tower)
        return 0
    wanted = parsed.dimensions
    if wanted is None or wanted == width:
        return width
    allowed = info.matryoshka
    if wanted < width and (allowed is True or wanted in (allowed or ())):
        return wanted
    fits = f"it was trained to be cut to {', '.join(map(str, allowed))}" if allowed and allowed is not True else (
        "it is not a matryoshka model: cutting its vectors would lose quality without warning")
    raise RequestError(400, "dimensions", f"dimensions={wanted}: {info.model_name!r} gives {width}-wide vectors and "
                                          f"{fits}; omit dimensions or pass {width}", kind="unsupported_dimensions")


def render(parsed: Parsed, width: int, info: EngineInfo, metrics, request: EncodeRequest, items: list) -> list[bytes]:
    """In a pool thread: the OpenAI response body (or the RequestError of the first failed input)."""
    for image, item in zip(request.images, items):
        if item.error is not None:
            where = f"input[{image.index}]" if parsed.field == "input" else "messages"
            message = item.error.message.replace(f"images[{image.index}]", where, 1)
            raise RequestError(500 if item.error.kind == "encoder_error" else 400, where, message, kind=item.error.kind)
    body, tokens, texts = Body(), 0, 0
    body.add(b'{"object":"list","data":[')
    for image, item in zip(request.images, items):
        vector = item.image.full[0, :width].float()
        if parsed.normalize:
            vector = torch.nn.functional.normalize(vector, dim=0)
        if parsed.encoding_format == "base64":
            embedding = b'"' + b64encode(vector.numpy().astype("<f4").tobytes()) + b'"'
        else:
            embedding = dumps(vector.tolist())
        body.add(b"," if image.index else b"", b'{"object":"embedding","index":', str(image.index).encode(),
                 b',"embedding":', embedding, b"}")
        tokens += int(np.prod(item.image.grid_thw))  # a text's "grid" is (1, 1, tokens)
        texts += image.text is not None
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    body.add(b'],"model":', dumps(info.model_name), b',"usage":', dumps(usage), b"}")
    metrics.images.inc(len(items) - texts)
    metrics.texts.inc(texts)
    return body.done()


def add_routes(app: FastAPI, service, drained, error, client_gone) -> None:
    """POST /v1/embeddings on `app` (mmenc.serving.app.create_app), with the app's own helpers:
    drained(route, request, handle) (authorization and the shutdown drain, as /v1/encode),
    error(RequestError, route) and client_gone(route) (the 499 answer)."""

    settings, metrics = service.settings, service.metrics

    @app.post(EMBEDDINGS, summary="Embeddings of texts and images (the OpenAI embeddings API)", response_model=None,
              responses={200: {"model": EmbeddingsResponse, "description": "one vector per input, in input order"},
                         **errors(400, 401, 404, 413, 415, 500, 503)},
              openapi_extra=request_body(EmbeddingsRequest))
    async def embeddings(request: Request):
        return await drained(EMBEDDINGS, request, handle)

    async def handle(request: Request, start: float):
        try:
            if service.state != "ready":
                raise RequestError(503, "model", f"the encoder is {service.state}"
                                   + (f" ({service.load_error})" if service.load_error else "; retry shortly"),
                                   kind="not_ready")
            content_type = request.headers.get("content-type", "")
            if content_type and not content_type.startswith("application/json"):
                raise RequestError(415, "content-type", f"content-type {content_type!r} is not supported; send "
                                                        f"application/json", kind="unsupported_media")
            body = await read_body(request, settings.max_request_bytes)
            loop = asyncio.get_running_loop()
            parsed = await loop.run_in_executor(service.pool, parse_embeddings, body, settings.max_images_per_request)
            info = service.engine.info
            width = check_model(parsed, info)
            payload = await until_disconnect(request, service.encode(
                parsed.request, render=functools.partial(render, parsed, width, info, metrics)))
        except ClientGone:  # the client went away: its inputs that have not reached a tower are dropped
            return client_gone(EMBEDDINGS)
        except RequestError as e:
            return error(e, EMBEDDINGS)
        metrics.requests.labels(route=EMBEDDINGS, status="200").inc()
        metrics.request_seconds.observe(time.perf_counter() - start)
        return PiecesResponse(payload)

