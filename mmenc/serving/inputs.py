"""Request bodies -> EncodeRequest: JSON (`{"images": [...], "format": ..., "uuids": [...]}`) or
multipart/form-data (one file part per image, optional `format` and `uuids` fields).

Whole-request problems raise RequestError (HTTP 400 naming the field); a single image that cannot be
read becomes that item's ItemError and the rest of the request still runs."""
import binascii
import dataclasses
import json
from typing import Any

from mmenc.preprocess.video_sampling import VideoOptions
from mmenc.serving.b64 import b64decode

FORMATS = ("vllm", "base64", "json")
DEFAULT_FORMAT = "vllm"
MAX_UUID_CHARS = 256
VIDEO_FIELDS = ("fps", "num_frames", "min_frames", "max_frames")  # sampling of the request's videos


class RequestError(ValueError):
    """A request the server refuses as a whole: status (400, 413, ...), the field at fault, a message."""

    def __init__(self, status: int, field: str, message: str, kind: str = "invalid_request"):
        super().__init__(message)
        self.status, self.field, self.message, self.kind = status, field, message, kind

    def body(self) -> dict:
        return {"error": {"type": self.kind, "field": self.field, "message": self.message}}


@dataclasses.dataclass(frozen=True)
class ItemError:
    """Why one image failed; becomes `{"index": i, "error": {"type": kind, "message": message}}`."""

    kind: str
    message: str


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One input of a request: an image's encoded file bytes (or the error that stopped us reading
    them), or a text to embed (`/v1/embeddings`)."""

    index: int
    uuid: str | None
    data: bytes | None = None
    error: ItemError | None = None
    text: str | None = None


@dataclasses.dataclass(frozen=True)
class EncodeRequest:
    """images: the inputs in order. pooled: each image's answer is its pooled embedding [1, dim] (the
    tower's pooling head), not its rows."""

    images: list[ImageInput]
    format: str
    video: dict = dataclasses.field(default_factory=dict)  # sampling fields for its videos (mmenc.serving.video)
    pooled: bool = False


def check_format(value: Any, pooled: bool = False) -> str:
    """The response format (default "vllm"; "base64" for pooled answers, which are not image_embeds)."""
    if value is None:
        return "base64" if pooled else DEFAULT_FORMAT
    if value not in FORMATS:
        raise RequestError(400, "format", f"format={value!r} is not supported; use one of {', '.join(FORMATS)}",
                           kind="unknown_format")
    if pooled and value == "vllm":
        raise RequestError(400, "format", "format='vllm' carries image_embeds rows; pooled answers (one vector per "
                                          "image) come as format 'base64' or 'json'", kind="unknown_format")
    return value


def check_pooled(value: Any) -> bool:
    """`pooled`: a JSON boolean, or a multipart field 'true' / 'false'."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    if not isinstance(value, bool):
        raise RequestError(400, "pooled", f"pooled={value!r} must be true or false")
    return value


def check_uuids(value: Any, count: int) -> list[str | None]:
    """uuids: a list of `count` strings (or nulls); each becomes a folder name under --ec-storage,
    so it may not contain '/', '\\' or NUL, nor be '.' or '..'."""
    if value is None:
        return [None] * count
    if not isinstance(value, list) or len(value) != count:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise RequestError(400, "uuids", f"uuids must be a list with one entry per image ({count}), got {got}")
    for i, u in enumerate(value):
        if u is None:
            continue
        if not isinstance(u, str) or not 0 < len(u) <= MAX_UUID_CHARS:
            raise RequestError(400, f"uuids[{i}]", f"uuids[{i}]={u!r} must be a string of 1..{MAX_UUID_CHARS} chars")
        if u in (".", "..") or any(c in u for c in "/\\\0"):
            raise RequestError(400, f"uuids[{i}]", f"uuids[{i}]={u!r} may not be '.'/'..' nor contain '/', '\\' "
                                                   f"or NUL (it names a folder of the encoder-cache directory)")
    return list(value)


def _decode_base64(text: str, index: int) -> ImageInput | bytes:
    try:
        data = b64decode(text)
    except (binascii.Error, ValueError) as e:
        return ImageInput(index, None, error=ItemError("invalid_base64", f"images[{index}]: not valid base64 ({e})"))
    if not data:
        return ImageInput(index, None, error=ItemError("invalid_image", f"images[{index}]: empty image (0 bytes)"))
    return data


def json_image(item: Any, index: int, uuid: str | None) -> ImageInput:
    """One JSON image entry (a data URL, or {"data": BASE64}) -> ImageInput (an ItemError for bad base64 or
    a string that is not a data URL; RequestError for an entry of another type)."""
    if isinstance(item, str):
        head, sep, payload = item.partition(",")
        if not item.startswith("data:"):
            return ImageInput(index, uuid, error=ItemError(
                "unsupported_input", f"images[{index}]: only data URLs ('data:image/png;base64,...') or "
                                     f"{{\"data\": BASE64}} are accepted, got a string starting {item[:24]!r}"))
        if not sep or not head.endswith(";base64"):
            return ImageInput(index, uuid, error=ItemError(
                "invalid_data_url", f"images[{index}]: data URL must be 'data:<mime>;base64,<data>', got "
                                    f"{item[:40]!r}"))
        text = payload
    elif isinstance(item, dict) and isinstance(item.get("data"), str):
        text = item["data"]
    else:
        raise RequestError(400, f"images[{index}]", f"images[{index}] must be a data URL string or "
                                                   f"{{\"data\": \"<base64>\"}}, got {type(item).__name__}")
    data = _decode_base64(text, index)
    if isinstance(data, ImageInput):
        return dataclasses.replace(data, uuid=uuid)
    return ImageInput(index, uuid, data=data)


def _check_count(count: int, max_images: int) -> None:
    if count == 0:
        raise RequestError(400, "images", "images is empty; send at least one image")
    if count > max_images:
        raise RequestError(400, "images", f"{count} images in one request exceeds max_images_per_request="
                                          f"{max_images}; split the request", kind="too_many_images")


def parse_json(body: bytes, max_images: int) -> EncodeRequest:
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, "body", f"body is not valid JSON ({e})") from e
    if not isinstance(doc, dict):
        raise RequestError(400, "body", f"body must be a JSON object, got {type(doc).__name__}")
    unknown = sorted(set(doc) - {"images", "format", "uuids", "pooled", *VIDEO_FIELDS})
    if unknown:
        raise RequestError(400, unknown[0], f"unknown field(s) {unknown}; expected images, format, uuids, pooled, "
                                            f"{', '.join(VIDEO_FIELDS)}")
    images = doc.get("images")
    if not isinstance(images, list):
        raise RequestError(400, "images", f"images must be a list of images, got {type(images).__name__}")
    pooled = check_pooled(doc.get("pooled", False))
    fmt = check_format(doc.get("format"), pooled)
    _check_count(len(images), max_images)
    uuids = check_uuids(doc.get("uuids"), len(images))
    return EncodeRequest([json_image(item, i, u) for i, (item, u) in enumerate(zip(images, uuids))], fmt,
                         _video_fields(doc), pooled)


def parse_form(files: list[bytes], fields: dict[str, list[str]], max_images: int) -> EncodeRequest:
    """files: the file parts' bytes in body order; fields: the text fields (`format`, `uuids`:
    repeated once per file, or one JSON list)."""
    unknown = sorted(set(fields) - {"format", "uuids", "pooled", *VIDEO_FIELDS})
    if unknown:
        raise RequestError(400, unknown[0], f"unknown form field(s) {unknown}; expected file parts, format, uuids, "
                                            f"pooled, {', '.join(VIDEO_FIELDS)}")
    _check_count(len(files), max_images)
    formats = fields.get("format", [])
    if len(formats) > 1:
        raise RequestError(400, "format", f"format given {len(formats)} times; give it once")
    pooled = check_pooled(fields.get("pooled", ["false"])[-1])
    fmt = check_format(formats[0] if formats else None, pooled)
    uuids = fields.get("uuids")
    if uuids is not None and len(uuids) == 1 and uuids[0].lstrip().startswith("["):
        try:
            uuids = json.loads(uuids[0])
        except json.JSONDecodeError as e:
            raise RequestError(400, "uuids", f"uuids is not a valid JSON list ({e})") from e
    uuids = check_uuids(uuids, len(files))
    items = [ImageInput(i, u, data=data) if data else
             ImageInput(i, u, error=ItemError("invalid_image", f"images[{i}]: empty file part (0 bytes)"))
             for i, (data, u) in enumerate(zip(files, uuids))]
    return EncodeRequest(items, fmt, _video_fields({k: v[-1] for k, v in fields.items()}), pooled)


def _video_fields(values: dict) -> dict:
    """The request's video sampling fields, checked (RequestError naming the field)."""
    video = {k: values[k] for k in VIDEO_FIELDS if values.get(k) is not None}
    video_options(video)
    return video


def video_options(values: dict[str, Any]) -> VideoOptions:
    """The request's sampling fields -> VideoOptions, or RequestError 400 naming the field."""
    kw = {}
    for name in VIDEO_FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if isinstance(value, str):  # a multipart field
            try:
                value = float(value) if name == "fps" else int(value)
            except ValueError as e:
                raise RequestError(400, name, f"{name}={value!r} is not a number") from e
        kw[name] = value
    try:
        return VideoOptions(**kw)
    except ValueError as e:
        raise RequestError(400, next(iter(kw), "fps"), str(e)) from e
