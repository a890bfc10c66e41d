"""Draining `mmenc serve --ray` on SIGTERM / SIGINT: the same contract as `mmenc serve`
(mmenc/serving/drain.py) across the replicas, before Serve is shut down.

    driver (mmenc.ray.serve.run)           DrainControl actor             each replica (follow)
    creates it, deploys ------------------------------------------------> register(id), wait() ...
    SIGTERM: drain(timeout) ------------> wakes every wait() ------------> service.drain.begin(timeout)
    polls busy() until 0 <--------------- idle(id, summary) <------------- nothing in flight any more
    serve.shutdown()

While a replica drains, its requests in flight go on; a request routed to it meanwhile is answered
503 shutting_down at once; past the timeout the rest are answered 503 shutting_down. Serve's proxy
and the replicas stay up until every replica is idle, so no connection is dropped with a request
on it ("Server disconnected without sending a response" before). A deployment started without
the driver (`serve run mmenc.ray.serve:app_builder`) has no DrainControl: Serve's own graceful
shutdown applies."""
import asyncio
import threading
import time

from mmenc.logger import init_logger

logger = init_logger(__name__)

NAMESPACE = "mmenc"


class DrainControl:
    """A small Ray actor (async: `wait` parks until `drain`) the replicas register with."""

    def __init__(self):
        self._event = asyncio.Event()
        self.timeout_s: float | None = None
        self.replicas: set[str] = set()
        self.summaries: dict[str, str] = {}

    def register(self, replica: str) -> None:
        self.replicas.add(replica)

    async def wait(self) -> float:
        await self._event.wait()
        return self.timeout_s

    def drain(self, timeout_s: float) -> int:
        """Wake every replica's wait(); returns how many replicas are registered."""
        self.timeout_s = timeout_s
        self._event.set()
        return len(self.replicas)

    def idle(self, replica: str, summary: str) -> None:
        self.summaries[replica] = summary

    def busy(self) -> int:
        """Replicas registered and not yet idle."""
        return len(self.replicas - set(self.summaries))

    def report(self) -> dict[str, str]:
        return dict(self.summaries)


def start_control(name: str):
    """The driver's DrainControl actor, named `name` in the mmenc namespace (the replicas look it up)."""
    import ray

    return ray.remote(num_cpus=0)(DrainControl).options(name=name, namespace=NAMESPACE).remote()


def drain_replicas(control, timeout_s: float, grace_s: float) -> dict[str, str]:
    """Ask every replica to drain; wait until each is idle (at most timeout_s + grace_s). Returns the
    replicas' summaries (replica id -> what its drain answered and cut)."""
    import ray

    count = ray.get(control.drain.remote(timeout_s))
    logger.info("mmenc serve --ray: draining %d replica(s): requests in flight get up to %.0f s", count, timeout_s)
    deadline = time.monotonic() + timeout_s + grace_s
    while time.monotonic() < deadline and ray.get(control.busy.remote()):
        time.sleep(0.2)
    busy = ray.get(control.busy.remote())
    if busy:
        logger.warning("mmenc serve --ray: %d replica(s) did not report idle within %.0f s; shutting down anyway",
                       busy, timeout_s + grace_s)
    return ray.get(control.report.remote())


def follow(service, name: str | None, grace_s: float) -> threading.Thread | None:
    """In a replica: a thread that registers with the DrainControl `name` (if there is one) and,
    when the driver asks, drains `service` and reports it idle."""
    if name is None:
        return None

    def run() -> None:
        import ray

        try:
            control = ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            logger.info("no drain control %r (deployed without `mmenc serve --ray`): Serve's own shutdown applies",
                        name)
            return
        replica = ray.get_runtime_context().get_actor_id()
        ray.get(control.register.remote(replica))
        timeout_s = ray.get(control.wait.remote())
        service.drain.begin(timeout_s)
        service.drain.wait_idle(timeout_s + grace_s)
        summary = service.drain.summary()
        logger.info("replica drained: %s", summary)
        ray.get(control.idle.remote(replica, summary))

    thread = threading.Thread(target=run, name="mmenc-drain", daemon=True)
    thread.start()
    return thread
