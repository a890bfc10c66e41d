"""A front-end process of `mmenc serve --frontends N` (started with the spawn context): uvicorn
with the service's FastAPI app on the listening socket the engine bound, an EncodeService over a
ProcessEngineClient. HTTP, auth, request parsing, base64 and image decoding, preprocessing and
rendering happen here; the tower, the batcher and the cache stay in the engine.

It stops (draining its requests, shutdown_timeout_s) when the engine says so, when the engine is
gone (its socket closes: the front end never outlives the engine), or on SIGTERM / SIGINT."""
import logging
import os
import shutil
import socket

from mmenc.logger import init_logger
from mmenc.serving.metrics import MULTIPROC_ENV
from mmenc.serving.settings import ServeSettings

logger = init_logger(__name__)

FRONTEND_HEADER = "x-mmenc-frontend"  # every response names the front end that served it


def frontend_main(settings: ServeSettings, listener: socket.socket, engine_sock: socket.socket, index: int,
                  shared_in_flight, log_level: str = "info") -> None:
    """Serve until stopped. shared_in_flight: the multiprocessing Value counting the images admitted
    by every front end (max_queue_images holds for the whole server)."""
    import uvicorn

    from mmenc.serving.app import create_app
    from mmenc.serving.frontends.remote import ProcessEngineClient
    from mmenc.shm import Channel, raise_fd_limit
    from mmenc.serving.metrics import ServeMetrics
    from mmenc.serving.host_threads import one_intra_op_thread
    from mmenc.serving.uvicorn_run import draining_server, run_draining
    from mmenc.serving.service import Admission, EncodeService

    logging.getLogger("mmenc").setLevel(log_level.upper())
    one_intra_op_thread(None, f"front end {index}")
    raise_fd_limit()  # each engine segment mapped here holds a descriptor
    holder: list[uvicorn.Server] = []

    def stop() -> None:
        if holder:
            holder[0].should_exit = True

    client = ProcessEngineClient(Channel(engine_sock), on_stop=stop)
    service = EncodeService(settings, metrics=ServeMetrics(), engine=client,
                            admission=Admission(settings.max_queue_images, shared=shared_in_flight))
    app = create_app(service, on_load_failure=stop)
    server = draining_server(app, service, settings, log_level, headers=[(FRONTEND_HEADER, str(index))])
    holder.append(server)
    run_draining(server, sockets=[listener])
    if service.drain.draining:
        logger.info("front end %d stopped: %s", index, service.drain.summary())
    if client.engine_gone:  # killed, it could not remove the metrics folder; the front ends do (all may try)
        shutil.rmtree(os.environ.get(MULTIPROC_ENV, ""), ignore_errors=True)
    logger.debug("front end %d stopped", index)
    # nothing is left to write (answers sent, metrics in their mmap'd files, shared segments are descriptors
    # the kernel frees): skip the interpreter's teardown of torch, which took seconds on a busy machine and
    # held up the engine's exit after a drain
    logging.shutdown()
    os._exit(0)
