"""The HTTP contract as typed models, served at GET /openapi.json (clients and fuzzers are generated from it).

The routes parse and render bodies themselves (mmenc.serving.inputs / formats: fast, one error contract);
these pydantic models describe the same bodies. A route that reads its body raw documents it with
`request_body(JsonModel, FormModel)` (its `openapi_extra`); a route that takes a typed body parameter,
or declares `responses={200: {"model": M}}`, appears in the schema by FastAPI's own means. `openapi(app)`
builds the document once: FastAPI's, with the models named by `request_body` added to components.
"""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from mmenc.serving.inputs import FORMATS, MAX_UUID_CHARS

Format = Literal[FORMATS]  # type: ignore[valid-type]


class ErrorDetail(BaseModel):
    type: str = Field(description="machine-readable kind, e.g. invalid_request, unknown_format, not_ready")
    field: str = Field(description="the request field at fault, e.g. images, images[3], body, authorization")
    message: str = Field(description="what was wrong and how to fix it")


class ErrorResponse(BaseModel):
    """Every answer that is not a success: 4xx and 5xx, whatever the route (docs/serving.md, Errors)."""

    error: ErrorDetail


class ImageData(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str = Field(description="base64 of the image (or video) file's bytes")


class EncodeJsonRequest(BaseModel):
    """POST /v1/encode with content-type application/json."""

    model_config = ConfigDict(extra="forbid")
    images: list[str | ImageData] = Field(min_length=1, description="data URLs ('data:image/png;base64,...') or "
                                                                    "{\"data\": BASE64}; 1..max_images_per_request")
    format: Format = Field("vllm", description="vllm: image_embeds content parts; base64: raw bytes; json: floats")
    uuids: list[str | None] | None = Field(None, description=f"one per image: its cache key and --ec-storage folder "
                                                             f"name (1..{MAX_UUID_CHARS} chars, no '/', '\\\\', NUL)")
    fps: float | None = Field(None, gt=0, description="videos: frames sampled per second")
    num_frames: int | None = Field(None, gt=0, description="videos: exactly this many frames")
    min_frames: int | None = Field(None, gt=0)
    max_frames: int | None = Field(None, gt=0)


class EncodeFormRequest(BaseModel):
    """POST /v1/encode with content-type multipart/form-data: one file part per image (any field name)."""

    images: list[bytes] = Field(json_schema_extra={"items": {"type": "string", "format": "binary"}},
                                description="the file parts, in order (any field name)")
    format: Format = "vllm"
    uuids: str | None = Field(None, description="repeated once per file, or one JSON list")
    fps: float | None = None
    num_frames: int | None = None
    min_frames: int | None = None
    max_frames: int | None = None


class ItemError(BaseModel):
    type: str = Field(description="invalid_base64, invalid_data_url, unsupported_input, invalid_image, "
                                  "image_too_large, unsupported_image, encoder_error, ...")
    message: str


class EncodeItem(BaseModel):
    """One input's answer; the format adds its fields (image_embeds / embedding, dtype, shape)."""

    model_config = ConfigDict(extra="allow")
    index: int
    uuid: str | None = None
    num_tokens: int | None = None
    grid_thw: list[int] | None = None
    cached: bool | None = None
    error: ItemError | None = None
    image_embeds: dict[str, Any] | None = Field(None, description="format vllm: the content part vLLM takes")
    embedding: str | list[list[float]] | None = Field(None, description="format base64 (a string) or json (floats)")
    dtype: str | None = None
    shape: list[int] | None = None


class Usage(BaseModel):
    images: int
    tokens: int


class EncodeResponse(BaseModel):
    model: str = Field(description="the served model name (--served-model-name)")
    data: list[EncodeItem]
    usage: Usage


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str = Field(description="the served model name: --served-model-name, else the Hub id or folder name")
    object: Literal["model"] = "model"
    architecture: str
    hidden_size: int
    image_embeds_size: int
    deepstack_levels: int
    dtype: str
    weights: Literal["checkpoint", "random"] = Field(description="random: load_format=dummy, meaningless embeddings")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: str = Field(description="ok, loading or failed")
    error: str | None = None


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries: each status answers an ErrorResponse."""
    return {status: {"model": ErrorResponse, "description": "the error contract"} for status in statuses}


def request_body(json_model: type[BaseModel], form_model: type[BaseModel] | None = None) -> dict[str, Any]:
    """`openapi_extra` for a route that parses its body itself: the body's JSON schema per content type
    (`openapi` moves the models, nested ones included, into components and refers to them)."""
    content = {"application/json": {"schema": json_model.model_json_schema(ref_template=_REF)}}
    if form_model is not None:
        content["multipart/form-data"] = {"schema": form_model.model_json_schema(ref_template=_REF)}
    return {"requestBody": {"required": True, "content": content}}


_REF = "#/components/schemas/{model}"


def openapi(app) -> dict[str, Any]:
    """The OpenAPI document of `app` (built once, then cached on it): FastAPI's, with the request
    models of `request_body` routes moved into components."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="mmenc's encoder service: docs/serving.md")
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path in doc.get("paths", {}).values():
        for operation in path.values():
            for media in operation.get("requestBody", {}).get("content", {}).values():
                schema = media.get("schema", {})
                if "title" in schema and "$ref" not in schema:
                    schemas.update(schema.pop("$defs", {}))
                    schemas[schema["title"]] = schema
                    media["schema"] = {"$ref": _REF.format(model=schema["title"])}
    app.openapi_schema = doc
    return doc
