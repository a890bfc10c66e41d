"""The worker process of a WorkerGroup: join the group, build this rank's tower, answer "run" calls.

Also what a spawned child does when it re-runs a main module that starts workers at import time
(no `if __name__ == "__main__":` guard): it stops at once, leaving a note the parent turns into a
one-line error (`unguarded_main_note`).
"""
import dataclasses
import datetime
import faulthandler
import os
import signal
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmenc.parallel.rank import build_rank_tower
from mmenc.parallel.transport import worker_endpoint

_FAULT_ACTIONS = ("raise", "exit", "hang")
UNGUARDED_MAIN_FIX = ('put the code that creates the Encoder (or WorkerGroup) under `if __name__ == "__main__":` '
                      'in your script: each worker process imports the main module and must not start workers itself')


def _note_path(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"mmenc-worker-{pid}.unguarded-main")


def stop_if_reimported_main() -> None:
    """In a spawned child that is importing its parent's main module (which tried to start workers):
    leave a note for the parent and exit quietly (one line on stderr instead of ~130 of tracebacks)."""
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    with open(_note_path(os.getpid()), "w") as f:
        f.write(UNGUARDED_MAIN_FIX)
    os.write(2, f"mmenc worker {os.getpid()}: not starting workers from a worker; {UNGUARDED_MAIN_FIX}\n".encode())
    os._exit(1)


def unguarded_main_note(pid: int) -> bool:
    """True (and the note removed) when worker `pid` stopped in `stop_if_reimported_main`."""
    path = _note_path(pid)
    if not os.path.exists(path):
        return False
    os.remove(path)
    return True


def check_fault(fault: dict | None, world_size: int) -> None:
    if fault is None:
        return
    if fault.get("at") not in ("start", "run") or fault.get("action") not in _FAULT_ACTIONS \
            or not 0 <= fault.get("rank", -1) < world_size:
        raise ValueError(f"_fault={fault!r} is not valid; expected {{'rank': 0..{world_size - 1}, "
                         f"'at': 'start'|'run', 'action': {'|'.join(_FAULT_ACTIONS)}, 'after': k}}")


def _inject(fault: dict | None, rank: int, at: str, count: int) -> None:
    if fault is None or fault["rank"] != rank or fault["at"] != at or count != fault.get("after", 0):
        return
    if fault["action"] == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at {at}")
    if fault["action"] == "exit":
        os._exit(3)
    time.sleep(1e9)  # hang


# -- the worker process ----------------------------------------------------------------------

def _watch_parent(parent_pid: int) -> None:
    """Exit when the caller is gone (it was killed without closing the group)."""
    def _parent_watch():
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)
    threading.Thread(target=_parent_watch, daemon=True, name="mmenc-parent-watch").start()


def _describe(loaded):
    """What the caller may keep of a LoadedTower: everything but modules and CUDA graphs."""
    if dataclasses.is_dataclass(loaded):
        return dataclasses.replace(loaded, graphs=None, **{f.name: None for f in dataclasses.fields(loaded)
                                                           if isinstance(getattr(loaded, f.name), torch.nn.Module)})
    return None


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker_main(rank, world, port, conn, recipe, mode, device_type, timeout_s, fault, parent_pid, stack_path):
    """The body of rank `rank`: messages ("run", call_id, payload, grid_thw) answered with
    ("ok", {"call": call_id, "stats", "output", "tokens"}) or ("error", traceback); ("stop",) ends it."""
    from mmenc.distributed import init_process_group, leave_process_group

    _watch_parent(parent_pid)
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=max(timeout_s, 60)))
        env = init_process_group(rank, world, rank, device_type, store=store, timeout_s=max(timeout_s, 60))
        if device_type == "cpu":  # share the cores instead of oversubscribing them
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        _inject(fault, rank, "start", 0)
        loaded = build_rank_tower(recipe, mode, env.device)
        endpoint = worker_endpoint(env.device)
        conn.send(("ok", _describe(loaded) if rank == 0 else None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    runs = 0
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                break
            if msg[0] == "stop":
                break
            _, call_id, payload, grid_thw = msg
            try:
                _inject(fault, rank, "run", runs)
                runs += 1
                start = time.perf_counter()
                pixel_values = endpoint.inputs(payload)
                out, tokens = None, []
                if grid_thw.shape[0]:  # data mode: this rank's own images only; weights mode: the whole pack
                    out = recipe.run(loaded, pixel_values, grid_thw)
                    tokens = loaded.output_tokens(grid_thw)
                _synchronize(env.device)
                stats = {"rank": rank, "tower_s": time.perf_counter() - start}
                reply = endpoint.reply(out) if out is not None and (mode == "data" or rank == 0) else None
                stats["total_s"] = time.perf_counter() - start
                conn.send(("ok", {"call": call_id, "stats": stats, "output": reply, "tokens": tokens}))
                del msg, payload, pixel_values, out, reply
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        del endpoint  # let go of the caller's input buffer
        leave_process_group()
