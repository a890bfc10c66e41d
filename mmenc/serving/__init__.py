"""`mmenc serve`: the encoder as an HTTP service (FastAPI + uvicorn) that LLM engines can use.

    settings = ServeSettings(port=8000, api_key=None, max_batch_patches=32768, cache_bytes=1 << 30)
    server, service = build_server(settings, lambda: Encoder(model, dtype=...))
    server.run()                       # until SIGTERM; or serve(settings, make_encoder)

Modules: settings (limits), inputs (request parsing), preprocess (one image), batcher (the only
caller of the tower), pending (one request between the event loop and its answer), cache (keys +
LRU), formats (vllm / base64 / json), tensor_bytes (torch.save bytes), b64 (base64), ec_storage
(vLLM's encoder-cache files), metrics (Prometheus), service (the pipeline, over an EngineClient),
local (LocalEngine: the Encoder, batcher and cache in this process), app (routes), server
(uvicorn), frontends/ (`--frontends N`: the engine process and N HTTP front-end processes).
The HTTP contract is docs/serving.md.
"""
from mmenc.serving.settings import ServeSettings, parse_size

__all__ = ["ServeSettings", "parse_size", "build_server", "serve"]


def __getattr__(name):  # the server needs fastapi/uvicorn (the "serve" extra); import them on use
    if name in ("build_server", "serve"):
        from mmenc.serving import server

        return getattr(server, name)
    raise AttributeError(f"module 'mmenc.serving' has no attribute {name!r}")
