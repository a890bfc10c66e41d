"""`mmenc serve --frontends N`: this process is the engine. It binds the listening socket (a port in
use fails here, once), loads the Encoder and runs the one Batcher and the encoder cache
(LocalEngine), and starts N front-end processes (spawn) that serve HTTP on that socket
(process.py) and hand it images through shared memory (hub.py, mmenc/shm.py).

Life cycle: SIGTERM / SIGINT: the front ends stop accepting and drain their requests
(shutdown_timeout_s) while the engine still answers them; then the batcher stops, the Encoder is
closed, exit 0. A front end that dies is logged and restarted (at most RESTARTS times per
RESTART_WINDOW_S per front end). A failed load: the front ends stop, exit 1.

The front ends are started with multiprocessing's spawn context, which imports the main module
again in each: a script calling `serve(ServeSettings(frontends=N), ...)` needs the usual
`if __name__ == "__main__":` guard (the `mmenc serve` command has it)."""
import collections
import multiprocessing
import multiprocessing.connection
import signal
import socket
import threading
import time
from collections.abc import Callable

from mmenc.logger import init_logger
from mmenc.serving.frontends.metrics_dir import MetricsDir
from mmenc.serving.settings import ServeSettings

logger = init_logger(__name__)

RESTARTS, RESTART_WINDOW_S = 5, 60.0
_POLL_S = 0.2


def bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """The listening socket every front end accepts on. reuse_port: SO_REUSEPORT, so other processes
    (mmenc.ray.direct's replicas) may listen on host:port too."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    try:
        return socket.create_server((host, port), family=family, backlog=2048, reuse_port=reuse_port)
    except OSError as e:
        shared = " (a process listening there without SO_REUSEPORT, e.g. a plain `mmenc serve`)" if reuse_port else ""
        raise ValueError(f"cannot listen on {host}:{port} ({e}); stop what uses the port{shared} or pass another "
                         f"--port") from e


class _Frontends:
    """The front-end processes: start, restart a dead one (bounded), stop all."""

    def __init__(self, settings: ServeSettings, listener: socket.socket, hub, metrics_dir: MetricsDir):
        self.settings, self.listener, self.hub, self.metrics_dir = settings, listener, hub, metrics_dir
        self.ctx = multiprocessing.get_context("spawn")
        self.in_flight = self.ctx.Value("q", 0)
        self.procs: dict[int, multiprocessing.Process] = {}
        self.deaths: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        from mmenc.serving.server import uvicorn_log_level

        self.log_level = uvicorn_log_level()

    def start(self, index: int) -> None:
        from mmenc.serving.frontends.process import frontend_main
        from mmenc.shm import Channel, socket_pair

        mine, theirs = socket_pair()
        proc = self.ctx.Process(target=frontend_main, name=f"mmenc-frontend-{index}", daemon=False,
                                args=(self.settings, self.listener, theirs, index, self.in_flight, self.log_level))
        proc.start()
        theirs.close()  # only the front end holds its end: its exit closes the connection
        self.procs[index] = proc
        self.hub.attach(f"{index} (pid {proc.pid})", Channel(mine))

    def reap(self) -> bool:
        """Restart the front ends that died; False when one may not be restarted any more."""
        for index, proc in list(self.procs.items()):
            if proc.is_alive():
                continue
            proc.join()
            self.metrics_dir.process_dead(proc.pid)
            deaths = self.deaths[index]
            deaths.append(time.monotonic())
            while deaths and deaths[0] < time.monotonic() - RESTART_WINDOW_S:
                deaths.popleft()
            if len(deaths) > RESTARTS:
                logger.error("front end %d (pid %d) exited with %s, its %d-th exit within %.0f s; not restarting it",
                             index, proc.pid, proc.exitcode, len(deaths), RESTART_WINDOW_S)
                del self.procs[index]
                return False
            logger.error("front end %d (pid %d) exited with %s; restarting it", index, proc.pid, proc.exitcode)
            self.start(index)
        return True

    def sentinels(self) -> list:
        return [p.sentinel for p in self.procs.values()]

    def stop(self, timeout: float) -> None:
        """Ask each front end to drain and exit; wait up to `timeout`, then terminate the rest."""
        self.hub.stop()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs.values():
            if proc.is_alive():
                logger.warning("front end pid %d did not exit within %.0f s; terminating it", proc.pid, timeout)
                proc.terminate()
                proc.join(5)
            self.metrics_dir.process_dead(proc.pid)


def serve_with_frontends(settings: ServeSettings, make_encoder: Callable[[], object], **engine_kwargs) -> int:
    """Serve in the foreground with settings.frontends front ends; 0 after a clean shutdown, 1 if the
    encoder failed to load or the front ends kept dying. engine_kwargs: LocalEngine's (batcher_factory)."""
    with MetricsDir() as metrics_dir:  # before anything here imports prometheus_client
        from mmenc.serving.frontends.hub import EngineHub
        from mmenc.serving.frontends.outputs import SharedOutputs
        from mmenc.shm import SegmentPool, raise_fd_limit
        from mmenc.serving.local import LocalEngine
        from mmenc.serving.metrics import ServeMetrics
        from mmenc.serving.uvicorn_run import CUT_GRACE_S, TOWER_WAIT_AFTER_CUT_S, exit_now, exit_while_loading

        listener = bind(settings.host, settings.port)
        raise_fd_limit()
        outputs = SharedOutputs(SegmentPool(), on_destroy=lambda segment: hub.forget(segment))  # hub: below
        engine = LocalEngine(settings, make_encoder, ServeMetrics(), alloc=outputs.alloc, **engine_kwargs)
        hub = EngineHub(engine, outputs)
        frontends = _Frontends(settings, listener, hub, metrics_dir)
        stop = threading.Event()
        previous = {sig: signal.signal(sig, lambda signum, frame: stop.set())
                    for sig in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            for index in range(settings.frontends):
                frontends.start(index)
            logger.info("mmenc serve: listening on http://%s:%d with %d front ends (loading the encoder; /health says "
                        "when ready)", settings.host, settings.port, settings.frontends)
            engine.start(on_failure=lambda: (hub.ready(), stop.set()), on_ready=hub.ready)
            while not stop.is_set():
                multiprocessing.connection.wait(frontends.sentinels(), timeout=_POLL_S)
                if not stop.is_set() and not frontends.reap():
                    logger.error("mmenc serve: a front end keeps exiting; stopping")
                    code = 1
                    break
            logger.info("mmenc serve: stopping: draining the front ends (up to %.0f s)", settings.shutdown_timeout_s)
            stopping = time.monotonic()
            frontends.stop(settings.shutdown_timeout_s + CUT_GRACE_S + 5)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            listener.close()
        # the front ends answered (or cut) every request: a tower call still running has no one waiting for
        # it; it gets what is left of the timeout, at least TOWER_WAIT_AFTER_CUT_S, then the process exits
        left = settings.shutdown_timeout_s - (time.monotonic() - stopping)
        engine.close(timeout=max(TOWER_WAIT_AFTER_CUT_S, left))
        if engine.loading():
            metrics_dir.remove()
            exit_while_loading(code)
        if engine.busy():
            metrics_dir.remove()
            exit_now(1 if engine.state == "failed" else code, "a tower call still runs")
        if engine.state == "failed":
            logger.error("mmenc serve: the encoder failed to load: %s", engine.load_error)
            return 1
        return code
