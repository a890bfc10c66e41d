"""Running uvicorn for the service, shared by the one-process server (server.py) and the front ends
(frontends/process.py): its settings, the HTTP protocol with a small send buffer, a drained run
under SIGTERM / SIGINT, and the exit used when a load is still running at shutdown."""
import logging
import multiprocessing
import os
import signal
import socket
import sys

import uvicorn

from mmenc.logger import init_logger
from mmenc.serving.settings import ServeSettings

logger = init_logger(__name__)

SEND_BUFFER_BYTES = 256 << 10  # SO_SNDBUF of each connection under uvloop (see _http_protocol)
CUT_GRACE_S = 5.0  # after the cut, how long uvicorn waits for the 503 answers to go out before it cancels tasks
TOWER_WAIT_AFTER_CUT_S = 1.0  # after the cut, how long a running tower call (its answers no longer wanted) is waited for


def uvicorn_config(app, settings: ServeSettings, log_level: str = "info", **overrides) -> uvicorn.Config:
    """The service's uvicorn settings (overrides: e.g. response headers of a front end)."""
    # uvicorn's own deadline comes after the service's cut (Drain), which answers every request first
    return uvicorn.Config(app, host=settings.host, port=settings.port, log_level=log_level,
                          timeout_graceful_shutdown=settings.shutdown_timeout_s + CUT_GRACE_S, access_log=False,
                          limit_concurrency=None, backlog=2048, http=_http_protocol(), **overrides)


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose shutdown (SIGTERM / SIGINT, or should_exit set by another thread) first
    begins the service's Drain: requests in flight get shutdown_timeout_s, then a 503 shutting_down."""

    def __init__(self, config: uvicorn.Config, drain, timeout_s: float):
        super().__init__(config)
        self.drain, self.timeout_s = drain, timeout_s

    async def shutdown(self, sockets=None) -> None:
        self.drain.begin(self.timeout_s)
        await super().shutdown(sockets)


def draining_server(app, service, settings: ServeSettings, log_level: str = "info", **overrides) -> DrainingServer:
    """The service's uvicorn server (not started), draining `service` at shutdown."""
    return DrainingServer(uvicorn_config(app, settings, log_level, **overrides), service.drain,
                          settings.shutdown_timeout_s)


def exit_now(code: int, why: str) -> None:
    """Exit with `code` now, leaving threads that still run torch behind (a normal interpreter exit
    would tear torch down under them: "terminate called without an active exception", SIGABRT)."""
    logger.info("mmenc serve: %s; exiting without waiting for it", why)
    for child in multiprocessing.active_children():  # e.g. tensor-parallel workers
        child.terminate()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def exit_while_loading(code: int = 0) -> None:
    """Exit with `code` now, leaving the encoder's loader thread behind (see serve)."""
    logger.info("mmenc serve: stopped while the encoder was loading; exiting without waiting for it")
    for child in multiprocessing.active_children():  # e.g. tensor-parallel workers started by the load
        child.terminate()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_draining(server: uvicorn.Server, sockets=None) -> None:
    """server.run(sockets): uvicorn handles SIGTERM/SIGINT (graceful drain), then re-raises the signal
    with the handlers it found: no-op ones here, so a drained server returns normally."""
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _ignore(signum, frame) -> None:
    logger.info("mmenc serve: stopped by %s", signal.Signals(signum).name)


def _http_protocol():
    """uvicorn's "auto" HTTP protocol (httptools if installed, else h11); under uvloop (installed: the
    loop "auto" picks) with SO_SNDBUF = SEND_BUFFER_BYTES on each connection. uvloop's transport
    writes what the socket takes at once while holding the GIL and hands the rest to libuv, which
    writes it with the GIL released; with the loopback default (megabytes) a whole 2.4 MB answer was
    copied into the kernel under the GIL (docs/serving.md, "Host side")."""
    import importlib.util

    if importlib.util.find_spec("uvloop") is None:
        return "auto"
    if importlib.util.find_spec("httptools") is not None:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    else:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base

    class Protocol(Base):
        def connection_made(self, transport) -> None:
            sock = transport.get_extra_info("socket")
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
            super().connection_made(transport)

    return Protocol
