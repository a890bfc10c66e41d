"""ServeSettings: every limit and knob of `mmenc serve`, validated once (the Encoder's own flags
travel separately, as `Encoder(**encoder_kwargs)`)."""
import dataclasses
import os
import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000 ** 2, "mb": 1000 ** 2, "g": 1000 ** 3, "gb": 1000 ** 3,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "t": 1000 ** 4, "tb": 1000 ** 4}


def parse_size(text: str | int, name: str) -> int:
    """'64MiB' / '1G' / '512kb' / '1048576' -> bytes. name: the flag, for the error message."""
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{name}={text!r} is not a size; write bytes with an optional unit, e.g. 1048576, "
                             f"512MiB, 2GiB, 1G ({', '.join(u for u in _UNITS if u)})")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value < 0:
        raise ValueError(f"{name}={text!r} must be >= 0")
    return value


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """host/port: where uvicorn listens. api_key: when set, /v1/* need `Authorization: Bearer KEY`.
    max_batch_patches / max_wait_ms: a tower call starts when the queued images reach this many
    patches, or this long after its first image was queued. cache_bytes: LRU encoder cache (0 = off).
    ec_storage: folder written for vLLM's file-based encoder-cache connector (None = off).
    max_request_bytes, max_images_per_request, max_image_pixels (decoded width*height),
    max_queue_images (images admitted and not yet answered; beyond it: 503 + Retry-After).
    preprocess_threads: decode/resize threads beside the tower. shutdown_timeout_s: how long SIGTERM
    waits for requests in flight. max_in_flight: tower calls launched and not yet handed back (2: the
    next call is queued on the device while one runs). bucket_batches: "on" cuts each call's images
    of one size to a power of two so CUDA graphs replay (docs/serving.md); "auto": on when the
    Encoder has cuda_graphs. frontends: 0 serves HTTP in this process; N > 0 makes this process the
    engine (tower, batcher, cache) and N front-end processes serve HTTP, decode and render
    (docs/serving.md, "Front ends"). served_model_name: the model's name in /v1/models and in answers
    (None: `served_name(model)`, the Hub id or the checkpoint folder's name, never its path)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_batch_patches: int = 32768
    max_wait_ms: float = 5.0
    cache_bytes: int = 1 << 30
    ec_storage: str | None = None
    max_request_bytes: int = 64 << 20
    max_images_per_request: int = 64
    max_image_pixels: int = 4096 * 4096
    max_queue_images: int = 1024
    preprocess_threads: int = dataclasses.field(default_factory=lambda: max(1, min(8, os.cpu_count() or 1)))
    retry_after_s: int = 1
    shutdown_timeout_s: float = 30.0
    max_in_flight: int = 2
    bucket_batches: str = "auto"
    frontends: int = 0
    served_model_name: str | None = None

    def __post_init__(self):
        positive = ("max_batch_patches", "max_request_bytes", "max_images_per_request", "max_image_pixels",
                    "max_queue_images", "preprocess_threads", "retry_after_s", "max_in_flight")
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ServeSettings.{field}={value!r} must be a positive integer")
        if not 0 < self.port < 65536:
            raise ValueError(f"ServeSettings.port={self.port} must be in 1..65535")
        if self.max_wait_ms < 0 or self.shutdown_timeout_s < 0 or self.cache_bytes < 0:
            raise ValueError(f"max_wait_ms={self.max_wait_ms}, shutdown_timeout_s={self.shutdown_timeout_s} and "
                             f"cache_bytes={self.cache_bytes} must be >= 0")
        if not isinstance(self.frontends, int) or self.frontends < 0:
            raise ValueError(f"ServeSettings.frontends={self.frontends!r} must be an integer >= 0 (0: HTTP in the "
                             f"engine's own process)")
        if self.bucket_batches not in ("auto", "on", "off"):
            raise ValueError(f"ServeSettings.bucket_batches={self.bucket_batches!r} must be 'auto', 'on' or 'off'")
        if self.served_model_name is not None and not (isinstance(self.served_model_name, str)
                                                       and self.served_model_name.strip()):
            raise ValueError(f"ServeSettings.served_model_name={self.served_model_name!r} must be a non-empty string "
                             f"(None: the checkpoint folder's name)")
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServeSettings.api_key is empty; pass a non-empty key or None for no authentication")
        if self.max_queue_images < self.max_images_per_request:
            raise ValueError(f"max_queue_images={self.max_queue_images} < max_images_per_request="
                             f"{self.max_images_per_request}: a full request could never be admitted; raise it")


def served_name(model: str) -> str:
    """The name a service shows for `model` by default: a Hub id or built-in name ("org/name") as given,
    a local checkpoint folder by its own name ("/models/Qwen2.5-VL-7B-Instruct" -> "Qwen2.5-VL-7B-Instruct")."""
    import pathlib

    path = pathlib.Path(model).expanduser()
    if not path.exists():
        return model
    return path.resolve().name or model
