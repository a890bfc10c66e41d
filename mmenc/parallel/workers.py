"""WorkerGroup: N processes that hold the tower (sharded: "weights", or one replica each: "data").

    recipe = TowerRecipe(dict(model=path, load_format="auto", dtype="bfloat16"))  # mmenc.engine.tower
    with WorkerGroup(2, recipe, mode="data") as group:
        out = group.run(pixel_values, grid_thw)        # TowerOutput in input image order

Every rank is a spawned worker; the calling process is not in the process group (it holds no
communicator), so a worker that raises, dies or hangs cannot take the caller with it: the caller
waits on pipes with a deadline and turns each failure into an error naming the rank (with the
worker's traceback), then shuts the group down.

One `run`: in data mode the caller assigns the images (`assign_images`) and hands each rank only
its own sub-pack; each rank runs it alone (no collective) and answers with its output; the caller
puts the pieces back in input order (`merge_outputs`). In weights mode every rank gets the whole
pack, the ranks all-reduce inside the tower, and rank 0 answers with the output.
How tensors travel is mmenc/parallel/transport.py's business: on CUDA, long-lived GPU buffers handed
over once by CUDA IPC (the caller writes each rank's images into that rank's buffer on its GPU;
outputs are read from the workers' GPUs onto `output_device`, default cuda:0, like a one-GPU
Encoder); on CPU, shared memory.
Under torchrun there are no spawned workers: see mmenc/parallel/rank.py.

Threads: `run` may be called from many threads at once; calls run one at a time (a lock around the
whole call), and every answer carries the id of the call it belongs to, checked on arrival, so a
result can never reach another call.
"""
import itertools
import os
import signal
import sys
import tempfile
import threading
import time
import weakref
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmenc.config import MultiModalConfig
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput
from mmenc.parallel.data import assign_images, merge_outputs, patch_counts
from mmenc.parallel.rank import TowerRecipe
from mmenc.parallel.transport import caller_transport
from mmenc.parallel.worker_process import (UNGUARDED_MAIN_FIX, check_fault, stop_if_reimported_main,
                                           unguarded_main_note, worker_main)

logger = init_logger(__name__)


class WorkerError(RuntimeError):
    """A worker raised or died; the message carries its rank and traceback (or exit code)."""


class WorkerGroup:
    """Start `world_size` workers, each building its tower with `recipe.build(device)` (a TowerRecipe:
    see mmenc/parallel/rank.py; the engine's is mmenc.engine.tower.TowerRecipe).

    mode: "weights" (tower sharded over all ranks; tp_size=world_size) or "data" (full replica per
        rank, tp_size=1; images split with `assign_images`). Weights mode falls back to data mode
        when the tower's heads (or another sharded size) do not divide by world_size: `mode` then
        says "data" and `mode_reason` why (also logged as a warning).
    device_type: "cuda" (NCCL, rank i on device i of CUDA_VISIBLE_DEVICES) or "cpu" (gloo).
    staging: CUDA only, how host inputs reach the GPUs: "pinned", "device" or "auto" (the faster of the
        two, timed on the first calls; see transport.CudaTransport).
    output_device: where `run` returns its result; default cuda:0 for "cuda" (rank 0's device),
        shared CPU memory for "cpu".
    timeout_s: the most one `run` may take before the group is declared hung (TimeoutError naming
        the ranks that did not answer); startup_timeout_s bounds process start + tower build
        (default max(timeout_s, 600)).
    _fault: TEST ONLY. {"rank": r, "at": "start" | "run", "action": "raise" | "exit" | "hang",
        "after": k} makes rank r fail at startup or at its (k+1)-th run (k defaults to 0).

    close() (also on `with` exit, garbage collection and interpreter exit) stops the workers and
    waits for them; `pids` lists them.
    """

    def __init__(self, world_size: int, recipe: TowerRecipe, mode: str = "weights", device_type: str = "cuda",
                 timeout_s: float = 600.0, *, output_device: torch.device | str | None = None, staging: str = "auto",
                 startup_timeout_s: float | None = None, _fault: dict | None = None):
        stop_if_reimported_main()
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be an int >= 1")
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"timeout_s={timeout_s!r} must be a positive number of seconds")
        self.mode = MultiModalConfig(mm_encoder_tp_mode=mode).mm_encoder_tp_mode
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type={device_type!r} is not supported by WorkerGroup; expected 'cuda' or 'cpu'")
        if device_type == "cuda" and world_size > (found := torch.cuda.device_count()):
            raise ValueError(f"world_size={world_size} needs {world_size} CUDA devices but {found} are visible "
                             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use "
                             f"tensor_parallel_size <= {found}")
        check_fault(_fault, world_size)
        check_cpu_workers(world_size, device_type)
        check_main_importable()
        self.mode, self.mode_reason = recipe.tp_mode(self.mode, world_size)
        if self.mode_reason:
            logger.warning(self.mode_reason)
        self.world_size, self.device_type, self.timeout_s = world_size, device_type, timeout_s
        self.output_device = torch.device(output_device if output_device is not None
                                          else "cuda:0" if device_type == "cuda" else "cpu")
        self._transport = caller_transport(device_type, world_size, self.output_device, staging)
        self._closed = False
        self._lock = threading.Lock()  # one call at a time, from any number of threads
        self._call_ids = itertools.count()
        self.last_stats: list[dict] = []  # per rank of the last run: tower_s, total_s
        self.last_timing: dict[str, float] = {}  # the caller's side of the last run: inputs, workers, outputs (ms)
        # The caller hosts the rendezvous store on a free port: no port race between workers.
        self._store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True, wait_for_workers=False)
        # where a worker writes its Python stacks on SIGUSR1 (read when it does not answer in time)
        self._stack_dir = tempfile.TemporaryDirectory(prefix="mmenc-workers-")
        ctx = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main, name=f"mmenc-worker-{rank}", daemon=True,
                               args=(rank, world_size, self._store.port, child, recipe, self.mode,
                                     device_type, timeout_s, _fault, os.getpid(),
                                     os.path.join(self._stack_dir.name, f"rank{rank}.stacks")))
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _shutdown, self._procs, self._conns, self._store, self._stack_dir)
        answers = self._collect("startup", max(timeout_s, 600.0) if startup_timeout_s is None else startup_timeout_s,
                                None)
        self._description = answers[0]
        logger.info("started %d %s workers (mode=%s, pids %s)", world_size, device_type, self.mode, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def describe(self):
        """Rank 0's LoadedTower with the tower module removed (processor, config, merge size ...)."""
        return self._description

    def run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, timeout_s: float | None = None) -> TowerOutput:
        """Run the tower over a pack. pixel_values [patches, C*tp*p*p] (any float dtype; on the CPU
        or a GPU), grid_thw int64 [N, 3]. Returns a TowerOutput in input image order, on
        `output_device` (CUDA groups: cuda:0 by default; CPU groups: shared CPU memory). Raises
        WorkerError when a worker raised or died, TimeoutError after `timeout_s` (default: the
        group's), both naming the rank; the group is closed after either. Safe from many threads:
        calls run one at a time."""
        with self._lock:
            return self._run(pixel_values, grid_thw, timeout_s)

    def _run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, timeout_s: float | None) -> TowerOutput:
        if self._closed:
            raise RuntimeError("this WorkerGroup is closed (after close() or a worker failure); start a new one")
        grid_thw = torch.as_tensor(grid_thw, dtype=torch.int64).cpu()
        if grid_thw.dim() != 2 or grid_thw.shape[0] == 0:
            raise ValueError(f"grid_thw must be [N >= 1, 3], got shape {tuple(grid_thw.shape)}")
        if self.mode == "data":
            assignment = assign_images(patch_counts(grid_thw), self.world_size)
        else:
            assignment = [list(range(grid_thw.shape[0]))] * self.world_size
        dtype = getattr(self._description, "dtype", None) or pixel_values.dtype
        t0 = time.perf_counter()
        payloads = self._transport.send_inputs(pixel_values, grid_thw, assignment, dtype)
        t1 = time.perf_counter()
        call_id = next(self._call_ids)
        for conn, payload, images in zip(self._conns, payloads, assignment):
            self._send(conn, ("run", call_id, payload, grid_thw[images]))
        answers = self._collect("run", self.timeout_s if timeout_s is None else timeout_s, call_id)
        self.last_stats = [a["stats"] for a in answers]
        t2 = time.perf_counter()
        if self.mode == "data":
            tokens = [0] * grid_thw.shape[0]
            for images, a in zip(assignment, answers):
                for i, n in zip(images, a["tokens"]):
                    tokens[i] = n
            outputs = [self._transport.read_output(r, a["output"], copy=False) for r, a in enumerate(answers)]
            out = merge_outputs(outputs, assignment, tokens)
        else:
            out = self._transport.read_output(0, answers[0]["output"], copy=True)
        self._transport.finish()
        t3 = time.perf_counter()
        self.last_timing = {"inputs_ms": (t1 - t0) * 1e3, "workers_ms": (t2 - t1) * 1e3, "outputs_ms": (t3 - t2) * 1e3,
                            **self._transport.last_timing}
        return out

    def close(self) -> None:
        """Stop the workers (a graceful stop, then SIGTERM, then SIGKILL) and wait for them. Idempotent."""
        self._closed = True
        self._transport = None  # unmap the workers' buffers before they exit
        self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals --------------------------------------------------------------------------
    def _send(self, conn, msg) -> None:
        try:
            conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, EOFError) as e:
            rank = self._conns.index(conn)
            self._fail(WorkerError(f"mmenc worker rank {rank} is gone ({e!r}; exit code "
                                   f"{self._procs[rank].exitcode}); the group is closed"))

    def _collect(self, phase: str, timeout_s: float, call_id: int | None) -> list:
        """One answer per rank, in rank order, each checked to answer call `call_id`; failures and
        timeouts close the group and raise."""
        answers, pending = [None] * self.world_size, set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            ready = wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                         timeout=max(left, 0))
            if not ready:
                self._fail(self._timeout_error(sorted(pending), timeout_s, phase))
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        status, payload = conn.recv()
                    except EOFError:
                        status, payload = "died", None
                elif proc.sentinel in ready:
                    status, payload = "died", None
                else:
                    continue
                if status == "error":
                    self._fail(WorkerError(f"mmenc worker rank {r} failed during {phase}:\n{payload}"))
                if status == "died":
                    proc.join(1)
                    if phase == "startup" and unguarded_main_note(proc.pid):
                        self._fail(RuntimeError(f"mmenc workers cannot start from this script: {UNGUARDED_MAIN_FIX}"))
                    self._fail(WorkerError(f"mmenc worker rank {r} exited with code {proc.exitcode} during {phase} "
                                           f"without reporting an error (killed, or crashed in native code)"))
                if call_id is not None and payload["call"] != call_id:
                    self._fail(WorkerError(f"mmenc worker rank {r} answered call {payload['call']} during call "
                                           f"{call_id}; the group is out of step and closed (this is a bug)"))
                answers[r] = payload
                pending.discard(r)
        return answers

    def _timeout_error(self, ranks: list[int], timeout_s: float, phase: str) -> TimeoutError:
        """Name the ranks that hung; a rank whose innermost frame is a torch.distributed collective
        is only waiting for them."""
        stacks = self._stacks(ranks)
        waiting = [r for r in ranks if "torch/distributed/" in stacks[r].split("  File ", 1)[-1].split("\n", 1)[0]]
        hung = [r for r in ranks if r not in waiting] or ranks
        names = lambda rs: f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"  # noqa: E731
        msg = f"mmenc worker {names(hung)} did not answer within {timeout_s:g}s during {phase} (hung)"
        if waiting and waiting != hung:
            msg += f"; {names(waiting)} waited for it in a collective"
        where = "\n".join(f"--- rank {r} ---\n{stacks[r]}" for r in ranks)
        return TimeoutError(f"{msg}. The group is closed. Where each was (most recent call first):\n{where}")

    def _stacks(self, ranks: list[int]) -> dict[int, str]:
        """The main-thread Python stack of each of `ranks` (faulthandler on SIGUSR1)."""
        for r in ranks:
            os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in ranks:
            path = os.path.join(self._stack_dir.name, f"rank{r}.stacks")
            text = open(path).read() if os.path.exists(path) else ""
            main = [b for b in text.strip().split("\n\n") if "in spawn_main" in b]  # the main thread's stack
            stacks[r] = main[-1].split("\n", 1)[-1] if main else (text.strip() or "(no stack written)")
        return stacks

    def _fail(self, error: Exception):
        self.close()
        raise error


def _shutdown(procs, conns, store, stack_dir, grace_s: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # that worker is already gone
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    stack_dir.cleanup()
    del store


def check_main_importable() -> None:
    """Workers are spawned: each imports the caller's main module. Fail early, in one line, when
    that module is a file that does not exist (code fed on stdin)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and path is not None and not os.path.exists(path):
        raise RuntimeError(f"mmenc workers cannot start: they import the main module, but it is {path!r}, not a "
                           f"file (code given on stdin?); save the code to a file with the Encoder created under "
                           f"`if __name__ == \"__main__\":`, or use `python -c`")


def check_cpu_workers(world_size: int, device_type: str) -> None:
    """CPU workers share the cores: more workers than cores is slow (a warning), more than twice
    as many is an error."""
    cores = os.cpu_count() or 1
    if device_type != "cpu" or world_size <= cores:
        return
    message = (f"tensor_parallel_size={world_size} starts {world_size} CPU worker processes on {cores} CPU "
               f"core{'s' if cores > 1 else ''}")
    if world_size > 2 * cores:
        raise ValueError(f"{message}; at most {2 * cores} (twice the cores) are allowed: use "
                         f"tensor_parallel_size <= {cores}")
    logger.warning("%s: they will compete for the cores; tensor_parallel_size <= %d runs faster", message, cores)
