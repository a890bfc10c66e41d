"""The HTTP routes (FastAPI): /health, /v1/models, /metrics, /openapi.json, POST /v1/encode, POST
/v1/embeddings (mmenc/serving/embeddings.py). See docs/serving.md.

Every answer that is not a success keeps one contract, `{"error": {"type", "field", "message"}}`: the
routes' own errors (RequestError), and what Starlette / FastAPI would answer in their own shapes (unknown
path or method, a malformed multipart body, a typed body that fails validation, an unexpected exception)."""
import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from mmenc.serving.http import ClientGone, PiecesResponse, read_body, until_disconnect
from mmenc.serving.inputs import EncodeRequest, RequestError, parse_form, parse_json
from mmenc.serving.schema import (EncodeFormRequest, EncodeJsonRequest, EncodeResponse, Health, ModelList, errors,
                                  openapi, request_body)
from mmenc.serving.service import EncodeService

ENCODE = "/v1/encode"


def create_app(service: EncodeService, on_load_failure=None) -> FastAPI:
    """The app for `service`; its lifespan starts loading the encoder and closes the service at
    shutdown (after uvicorn has finished the requests in flight)."""
    settings, metrics = service.settings, service.metrics

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start_loading(on_failure=on_load_failure)
        yield
        await asyncio.get_running_loop().run_in_executor(None, service.close)

    app = FastAPI(title="mmenc encoder service", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    app.openapi = lambda: openapi(app)
    install_error_contract(app, metrics)

    def error(exc: RequestError, route: str) -> JSONResponse:
        metrics.errors.labels(kind=exc.kind).inc()
        metrics.requests.labels(route=route, status=str(exc.status)).inc()
        headers = {"Retry-After": str(settings.retry_after_s)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    def authorize(request: Request, route: str) -> JSONResponse | None:
        if settings.api_key is None:
            return None
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), settings.api_key.encode()):
            return None
        return error(RequestError(401, "authorization", "missing or wrong API key; send "
                                                        "'Authorization: Bearer <key>'", kind="unauthorized"), route)

    @app.get("/health", response_model=None, responses={200: {"model": Health}, 503: {"model": Health}})
    async def health():
        if service.state == "ready":
            return {"status": "ok"}
        body = {"status": service.state, **({"error": service.load_error} if service.load_error else {})}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(settings.retry_after_s)})

    @app.get("/metrics")
    async def prometheus():  # rendered off the event loop: a shared cache's counters are a blocking call (Ray)
        return Response(await asyncio.to_thread(metrics.render), media_type=metrics.content_type)

    @app.get("/v1/models", response_model=None, responses={200: {"model": ModelList}, **errors(401, 503)})
    async def models(request: Request):
        refused = authorize(request, "/v1/models")
        if refused is not None:
            return refused
        if service.state != "ready":
            return error(RequestError(503, "model", f"the encoder is {service.state}", kind="not_ready"), "/v1/models")
        return {"object": "list", "data": [service.card]}

    async def drained(route: str, request: Request, handle) -> Response:
        """`await handle(request, start)` under the service's Drain: refused (503 shutting_down) once the
        server is stopping, cut (503) past --shutdown-timeout; the host cancelling it leaves the drain."""
        start = time.perf_counter()
        refused = authorize(request, route)
        if refused is not None:
            return refused
        drain = service.drain
        if not drain.enter():  # the server is stopping: retry elsewhere or later
            return error(shutting_down("the server is shutting down and takes no new requests"), route)
        loop = asyncio.get_running_loop()
        cut = loop.create_future()
        forget = drain.on_cut(lambda: loop.call_soon_threadsafe(_set_once, cut))
        handling = asyncio.ensure_future(handle(request, start))
        try:
            await asyncio.wait({handling, cut}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the host gave up on this request (e.g. uvicorn past its own timeout)
            handling.cancel()
            drain.leave()
            raise
        finally:
            forget()
        if handling.done():
            drain.leave()
            return handling.result()
        handling.cancel()  # past --shutdown-timeout: drop its inputs not yet in a tower call, answer 503
        with contextlib.suppress(asyncio.CancelledError):
            await handling
        drain.leave(cut=True)
        return error(shutting_down(f"the server is shutting down and the request was not done within "
                                   f"--shutdown-timeout {settings.shutdown_timeout_s:g} s"), route)

    def client_gone(route: str) -> Response:
        metrics.requests.labels(route=route, status="499").inc()
        return Response(status_code=499)

    @app.post(ENCODE, response_model=None, responses={200: {"model": EncodeResponse}, **errors(400, 401, 413, 415, 503)},
              openapi_extra=request_body(EncodeJsonRequest, EncodeFormRequest))
    async def encode(request: Request):
        return await drained(ENCODE, request, handle)

    async def handle(request: Request, start: float):
        try:
            parsed = await read_request(request, settings.max_request_bytes, settings.max_images_per_request,
                                        service.pool)
            payload = await until_disconnect(request, service.encode(parsed))
        except ClientGone:  # the client went away: its images that have not reached the tower are dropped
            return client_gone(ENCODE)
        except RequestError as e:
            return error(e, ENCODE)
        metrics.requests.labels(route=ENCODE, status="200").inc()
        metrics.request_seconds.observe(time.perf_counter() - start)
        return PiecesResponse(payload)

    from mmenc.serving.embeddings import add_routes

    add_routes(app, service, drained, error, client_gone)
    return app


def shutting_down(message: str) -> RequestError:
    """503 shutting_down: retryable (Retry-After), on another replica or once the server is back."""
    return RequestError(503, "server", message + "; retry the request", kind="shutting_down")


def _set_once(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


async def read_request(request: Request, limit: int, max_images: int, pool) -> EncodeRequest:
    """The body (at most `limit` bytes) parsed; JSON is parsed and its base64 decoded in `pool`."""
    content_type = request.headers.get("content-type", "")
    body = await read_body(request, limit)
    if content_type.startswith("multipart/form-data"):
        return await _read_form(request, body, max_images)
    if content_type and not content_type.startswith("application/json"):
        raise RequestError(415, "content-type", f"content-type {content_type!r} is not supported; send "
                                                f"application/json or multipart/form-data", kind="unsupported_media")
    return await asyncio.get_running_loop().run_in_executor(pool, parse_json, body, max_images)


async def _read_form(request: Request, body: bytes, max_images: int) -> EncodeRequest:
    async def replay():
        return {"type": "http.request", "body": body, "more_body": False}

    from starlette.formparsers import MultiPartException

    try:
        form = await Request(request.scope, replay).form(max_files=max_images + 1, max_fields=max_images + 8)
    except MultiPartException as e:
        raise RequestError(400, "body", f"multipart body cannot be parsed ({e.message}); send one file part per "
                                        f"image, e.g. curl -F image=@cat.jpg") from e
    except HTTPException as e:  # Starlette turns the parser's errors into these inside an app
        raise RequestError(e.status_code if 400 <= e.status_code < 500 else 400, "body",
                           f"multipart body cannot be parsed ({e.detail}); send one file part per image, e.g. "
                           f"curl -F image=@cat.jpg") from e
    files, fields = [], {}
    for name, value in form.multi_items():
        if isinstance(value, UploadFile):
            files.append(await value.read())
        else:
            fields.setdefault(name, []).append(value)
    await form.close()
    return parse_form(files, fields, max_images)


_HTTP_KINDS = {404: ("not_found", "path"), 405: ("method_not_allowed", "method")}


def install_error_contract(app: FastAPI, metrics) -> None:
    """Exception handlers that answer in the error contract where Starlette/FastAPI have shapes of their own."""

    def answer(status: int, kind: str, field: str, message: str, headers=None) -> JSONResponse:
        metrics.errors.labels(kind=kind).inc()
        return JSONResponse(RequestError(status, field, message, kind=kind).body(), status_code=status,
                            headers=headers)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        kind, field = _HTTP_KINDS.get(exc.status_code, ("invalid_request", "body"))
        message = str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.url.path!r}; see GET /openapi.json for the routes"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path!r}; see GET /openapi.json"
        return answer(exc.status_code, kind, field, message, getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        first = (exc.errors() or [{}])[0]
        where = ".".join(str(part) for part in first.get("loc", ("body",)) if part != "body") or "body"
        return answer(422, "invalid_request", where, f"{where}: {first.get('msg', 'invalid value')}")

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):  # logged by Starlette with its traceback too
        return answer(500, "internal_error", "server", f"internal error ({type(exc).__name__}); the server log "
                                                       f"has the traceback")
