"""Start and stop the service with uvicorn. SIGTERM / SIGINT: stop accepting connections, finish the
requests in flight (up to shutdown_timeout_s), then stop the batcher and close the Encoder."""
import logging
from collections.abc import Callable

import uvicorn

from mmenc.logger import init_logger
from mmenc.serving.app import create_app
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.service import EncodeService
from mmenc.serving.settings import ServeSettings
from mmenc.serving.uvicorn_run import (SEND_BUFFER_BYTES, _http_protocol, draining_server, exit_now,
                                       exit_while_loading, run_draining, uvicorn_config)

logger = init_logger(__name__)

__all__ = ["SEND_BUFFER_BYTES", "build_server", "serve", "uvicorn_config", "_http_protocol", "exit_while_loading",
           "run_draining"]


def uvicorn_log_level() -> str:
    """uvicorn's level: "info" while mmenc logs INFO, else "warning" (mmenc serve -q)."""
    return "info" if logger.getEffectiveLevel() <= logging.INFO else "warning"


def build_server(settings: ServeSettings, make_encoder: Callable[[], object], log_level: str = "info",
                 **service_kwargs) -> tuple[uvicorn.Server, EncodeService]:
    """A uvicorn.Server (not started) and its service; `server.run()` serves until SIGTERM, or
    `server.should_exit = True` from another thread. If loading the encoder fails the server stops.
    service_kwargs: EncodeService's keyword options (batcher_factory)."""
    service = EncodeService(settings, make_encoder, ServeMetrics(), **service_kwargs)
    holder: list[uvicorn.Server] = []

    def stop():
        holder[0].should_exit = True

    app = create_app(service, on_load_failure=stop)
    server = draining_server(app, service, settings, log_level)
    holder.append(server)
    return server, service


def serve(settings: ServeSettings, make_encoder: Callable[[], object], **service_kwargs) -> int:
    """Serve in the foreground; 0 after a clean shutdown, 1 if the encoder failed to load. With
    settings.frontends > 0 this process is the engine and N front-end processes serve HTTP
    (mmenc/serving/frontends/engine.py). The port is bound first: one in use raises ValueError
    before anything loads. uvicorn logs at INFO only while the `mmenc` logger does (-q: warnings)."""
    from mmenc.serving.frontends.engine import bind

    if settings.frontends > 0:
        from mmenc.serving.frontends.engine import serve_with_frontends

        return serve_with_frontends(settings, make_encoder, **service_kwargs)
    listener = bind(settings.host, settings.port)
    server, service = build_server(settings, make_encoder, log_level=uvicorn_log_level(), **service_kwargs)
    logger.info("mmenc serve: listening on http://%s:%d (loading the encoder; /health says when ready)",
                settings.host, settings.port)
    # uvicorn handles SIGTERM/SIGINT (graceful drain), then re-raises the signal with the handlers it
    # found: no-op ones here, so a drained server returns normally and the command exits 0.
    try:
        run_draining(server, sockets=[listener])
    finally:
        listener.close()
    if service.drain.draining:
        logger.info("mmenc serve: stopped: %s", service.drain.summary())
    if service.loading():
        # stopped while the encoder was loading, and the load did not stop within shutdown_timeout_s: a
        # normal interpreter exit would tear torch down under the loader thread ("terminate called
        # without an active exception", SIGABRT); nothing was served, nothing is left to flush but the logs
        exit_while_loading()
    if service.busy():  # a tower call outlived the wait after the cut: its answer is not needed any more
        exit_now(1 if service.state == "failed" else 0, "a tower call still runs")
    if service.state == "failed":
        logger.error("mmenc serve: the encoder failed to load: %s", service.load_error)
        return 1
    return 0
