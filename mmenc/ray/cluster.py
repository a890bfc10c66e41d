"""Join a Ray cluster, or start a local one that listens on loopback only."""
import os

# Ray reads this when it is first imported: "0" makes a local Ray pick 127.0.0.1 as its node address,
# so every server it starts (GCS, raylet, object manager, workers) listens on loopback only.
_LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def quiet_ray_logs() -> None:
    """Ray's Python log lines off the terminal (`-q`): Ray Data's execution plan and finish lines, its
    progress-bar notice, Serve's. Call after connect (Ray Data sets its loggers up when imported); Ray's
    log files under /tmp/ray keep everything. Lines Ray's C++ core prints itself (the auth-mode notice) stay."""
    import logging

    import ray.data  # noqa: F401  (configures the loggers set below)

    for name in ("ray", "ray.data", "ray.serve"):
        logging.getLogger(name).setLevel(logging.ERROR)


def import_ray():
    """`ray`, or a ValueError saying how to install it."""
    try:
        import ray
    except ModuleNotFoundError as e:
        raise ValueError(f"--ray needs {e.name}; install the ray extra: pip install 'mmenc[ray]'") from e
    return ray


def start_local(num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """A new single-node Ray instance owned by this process, bound to 127.0.0.1, without dashboard;
    True when started, False when this process is already connected to a Ray. Must run before
    anything imports ray in this process (Ray reads its network switch on import)."""
    import sys

    if "ray" not in sys.modules:
        os.environ.setdefault(_LOOPBACK_ONLY, "0")
    ray = import_ray()
    if ray.is_initialized():
        return False
    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    return True


def connect(address: str | None, num_cpus: int | None = None, num_gpus: int | None = None) -> bool:
    """Join the cluster at `address` ("auto": the one `ray start` made on this node), or start a local
    one when address is None. True when this call started Ray (and its caller should shut it down)."""
    if address is None:
        return start_local(num_cpus=num_cpus, num_gpus=num_gpus)
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(address=address, log_to_driver=False)
    return False


def cluster_gpus() -> float:
    """GPUs in the cluster (0 on a CPU-only cluster)."""
    return float(import_ray().cluster_resources().get("GPU", 0))
