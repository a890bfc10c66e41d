"""The folder of prometheus_client's multiprocess mode for one `mmenc serve --frontends N`: created
fresh and named in PROMETHEUS_MULTIPROC_DIR before this process imports prometheus_client (the
mode is fixed at that import) and inherited by the front ends it spawns; removed at exit."""
import os
import shutil
import sys
import tempfile

from mmenc.serving.metrics import MULTIPROC_ENV


class MetricsDir:
    def __init__(self):
        self.path: str | None = None
        self._previous: str | None = None

    def __enter__(self) -> "MetricsDir":
        if "prometheus_client" in sys.modules and not os.environ.get(MULTIPROC_ENV):
            raise RuntimeError("prometheus_client was imported before `mmenc serve --frontends` could switch it to "
                               "multiprocess mode; start the server in a fresh process (the `mmenc serve` command), "
                               f"or set {MULTIPROC_ENV} to an empty folder before importing prometheus_client")
        self._previous = os.environ.get(MULTIPROC_ENV)
        self.path = tempfile.mkdtemp(prefix="mmenc-metrics-")
        os.environ[MULTIPROC_ENV] = self.path
        return self

    def process_dead(self, pid: int) -> None:
        """Drop the live gauges of a process that exited (its counters and histograms still count)."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.path)

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.remove()
        if self._previous is None:
            os.environ.pop(MULTIPROC_ENV, None)
        else:
            os.environ[MULTIPROC_ENV] = self._previous
