"""How a WorkerGroup's tensors travel between the calling process and its workers.

Caller side: `send_inputs(pixel_values, grid_thw, assignment, dtype)` gives one small payload per
rank (sent with the "run" message); `read_output(rank, reply, copy)` turns a worker's reply into a
TowerOutput on the output device. Worker side: `inputs(payload)` -> pixel_values on the worker's
device; `reply(out)` -> what to send back.

CUDA (`CudaTransport` / `CudaEndpoint`): buffers that live as long as the group, handed over once
by CUDA IPC, so a call maps no new memory:
- input: per rank, a device buffer on the rank's GPU owned by the caller. A call writes each rank's
  images there, waits for the copies, then tells each worker how many rows to read. Host input is
  staged one of two ways (`CudaTransport(staging=...)`): "pinned" converts the images to the tower's
  dtype in a pinned host buffer and copies to every GPU at once (asynchronous from pinned memory);
  "device" copies them as they are from pageable memory, one thread per GPU, and converts on the
  GPU; "auto" times both and keeps the faster. Input already on a GPU is copied device to device.
- output: per rank, a device buffer on the rank's GPU owned by the worker. The worker copies its
  output tensors into it and answers with their layout; the caller reads them from there straight
  onto the output device (a peer copy from another GPU).
A buffer that is too small is replaced by one 1.5x the size needed, handed over again.

CPU (`ShmTransport` / `ShmEndpoint`): inputs and outputs are copied into shared memory and sent by
handle (torch.multiprocessing).
"""
import concurrent.futures
import statistics
import time

import torch

from mmenc.parallel.data import flatten_output, pack_for_rank, patch_counts, unflatten_output
from mmenc.logger import init_logger
from mmenc.models.base import TowerOutput

logger = init_logger(__name__)

_ALIGN = 256  # bytes; every tensor in an output buffer starts on this boundary
_GROWTH = 1.5


def _grown(buffer: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device,
           pin: bool = False) -> torch.Tensor | None:
    """A new buffer of 1.5x `numel` when `buffer` is missing, smaller or of another dtype; else None."""
    if buffer is not None and buffer.dtype == dtype and buffer.numel() >= numel:
        return None
    size = max(int(numel * _GROWTH), 1)
    if device.type == "cpu":
        return torch.empty(size, dtype=dtype, pin_memory=pin)
    return torch.empty(size, dtype=dtype, device=device)


STAGINGS = ("pinned", "device")


class StagingChooser:
    """staging="auto": calls alternate between the stagings until each has timed `trials` calls of at
    least `min_bytes` of input; then the one with the lower median time per byte is kept for the rest
    of the group's life.

    Why measure: on the H200 host, pinned staging took 4-5 ms for 77-103 MB in a process that never
    ran torch.compile, but 60-255 ms in one that had (its host-side conversion slowed down; cause not
    found), where device staging took 14-17 ms either way."""

    def __init__(self, trials: int = 3, min_bytes: int = 8 << 20):
        self.trials, self.min_bytes = trials, min_bytes  # smaller inputs time overheads, not staging: not counted
        self.samples: dict[str, list[float]] = {s: [] for s in STAGINGS}
        self._calls = -1
        self.choice: str | None = None

    def next(self) -> str:
        if self.choice is not None:
            return self.choice
        self._calls += 1
        return STAGINGS[self._calls % len(STAGINGS)]  # alternate, pinned first

    def record(self, staging: str, seconds: float, nbytes: int) -> None:
        if self.choice is not None or nbytes < self.min_bytes:
            return
        self.samples[staging].append(seconds / nbytes)
        if all(len(v) >= self.trials for v in self.samples.values()):
            self.choice = min(STAGINGS, key=lambda s: statistics.median(self.samples[s]))
            per_gb = {s: statistics.median(v) * 1e12 for s, v in self.samples.items()}
            logger.info("input staging: %s (%s)", self.choice,
                        ", ".join(f"{s} {ms:.1f} ms/GB" for s, ms in per_gb.items()))


class CudaTransport:
    """The caller's side on CUDA: rank r's GPU is cuda:r. See the module docstring.

    staging (host input only): "pinned" converts each rank's images to the tower's dtype in a pinned
    host buffer and copies asynchronously to every GPU at once; "device" copies them as they are
    (pageable) to the rank's GPU, one thread per rank, and converts there; "auto" (default) times
    both on the first calls and keeps the faster (`StagingChooser`).
    `last_timing`: the last send_inputs' split, "stage_ms" (host work) and "copy_wait_ms"."""

    def __init__(self, world_size: int, output_device: torch.device, staging: str = "auto"):
        if staging not in (*STAGINGS, "auto"):
            raise ValueError(f"staging={staging!r} is not valid; expected one of {(*STAGINGS, 'auto')}")
        self.world_size, self.output_device, self.staging = world_size, output_device, staging
        self._chooser = StagingChooser() if staging == "auto" else None
        self._device_in: list[torch.Tensor | None] = [None] * world_size
        self._pinned: list[torch.Tensor | None] = [None] * world_size
        self._out: list[torch.Tensor | None] = [None] * world_size  # the workers' output buffers, mapped
        self.last_timing: dict[str, float] = {}

    def send_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, assignment: list[list[int]],
                    dtype: torch.dtype) -> list[dict]:
        start = time.perf_counter()
        pixel_values = pixel_values.detach()
        counts, features = patch_counts(grid_thw), pixel_values.shape[1]
        payloads, targets = [], {}
        for r, images in enumerate(assignment):
            rows = sum(counts[i] for i in images)
            new = _grown(self._device_in[r], rows * features, dtype, torch.device("cuda", r)) if rows else None
            if new is not None:
                self._device_in[r] = new
            if rows:
                targets[r] = self._device_in[r][:rows * features].view(rows, features)
            payloads.append({"buffer": new, "rows": rows, "features": features})
        staging = "device-to-device" if pixel_values.is_cuda else self._chooser.next() if self._chooser else self.staging
        if staging == "device-to-device":
            for r, target in targets.items():
                pack_for_rank(pixel_values, grid_thw, assignment[r], out=target)
        elif staging == "pinned":
            self._stage_pinned(pixel_values, grid_thw, assignment, targets)
        else:
            self._stage_device(pixel_values, grid_thw, assignment, targets)
        staged = time.perf_counter()
        for r in range(self.world_size):  # the copies are done (and pinned memory free) before workers read
            torch.cuda.current_stream(r).synchronize()
        done = time.perf_counter()
        if self._chooser is not None and staging in STAGINGS:
            self._chooser.record(staging, done - start,
                                 sum(t.numel() * t.element_size() for t in targets.values()))
        self.last_timing = {"stage_ms": (staged - start) * 1e3, "copy_wait_ms": (done - staged) * 1e3}
        return payloads

    def _stage_pinned(self, pixel_values, grid_thw, assignment, targets) -> None:
        staged = {}  # images -> their rows in pinned memory (weights mode: one copy for every rank)
        for r, target in targets.items():
            key = tuple(assignment[r])
            if key not in staged:
                with torch.cuda.device(r):  # pinned under the context of the GPU that reads it
                    pinned = _grown(self._pinned[r], target.numel(), target.dtype, torch.device("cpu"), pin=True)
                if pinned is not None:
                    self._pinned[r] = pinned
                staged[key] = self._pinned[r][:target.numel()].view(target.shape)
                pack_for_rank(pixel_values, grid_thw, assignment[r], out=staged[key])  # converts on the CPU
            with torch.cuda.device(r):
                target.copy_(staged[key], non_blocking=True)

    def _stage_device(self, pixel_values, grid_thw, assignment, targets) -> None:
        def copy(r: int) -> None:
            with torch.cuda.device(r):
                raw, _ = pack_for_rank(pixel_values, grid_thw, assignment[r], device=f"cuda:{r}")
                targets[r].copy_(raw)  # the dtype conversion runs on the GPU

        with concurrent.futures.ThreadPoolExecutor(max(len(targets), 1)) as pool:
            list(pool.map(copy, targets))

    def read_output(self, rank: int, reply: dict | None, copy: bool) -> TowerOutput | None:
        """The worker's output on the output device; copy=False leaves tensors that are there already
        in the worker's buffer (the caller must copy them before the next call)."""
        if reply is None:
            return None
        if reply["buffer"] is not None:
            self._out[rank] = reply["buffer"]
        buffer = self._out[rank]
        flat = [buffer[offset:offset + nbytes].view(dtype).view(shape).to(self.output_device, copy=copy)
                for offset, nbytes, dtype, shape in reply["layout"]]
        return unflatten_output(flat, reply["skeleton"])

    def finish(self) -> None:
        """Wait until every copy out of the workers' buffers is done (they are rewritten next call)."""
        for r in range(self.world_size):
            torch.cuda.synchronize(r)
        torch.cuda.ipc_collect()  # release replaced buffers the workers no longer map


class CudaEndpoint:
    """A worker's side on CUDA: the caller's input buffer mapped once, its own output buffer."""

    def __init__(self, device: torch.device):
        self.device = device
        self._in: torch.Tensor | None = None
        self._out: torch.Tensor | None = None

    def inputs(self, payload: dict) -> torch.Tensor:
        if payload["buffer"] is not None:
            self._in = payload["buffer"]  # the old one (if any) is released
        rows, features = payload["rows"], payload["features"]
        if not rows:
            return torch.empty(0, features, device=self.device)
        return self._in[:rows * features].view(rows, features)

    def reply(self, out: TowerOutput) -> dict:
        flat, skeleton = flatten_output(out, out.embeddings.shape[0])
        layout, offset = [], 0
        for t in flat:
            nbytes = t.numel() * t.element_size()
            layout.append((offset, nbytes, t.dtype, tuple(t.shape)))
            offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        torch.cuda.ipc_collect()  # frees a replaced output buffer once the caller has let it go
        new = _grown(self._out, offset, torch.uint8, self.device)
        if new is not None:
            self._out = new
        for (start, nbytes, dtype, shape), t in zip(layout, flat):
            self._out[start:start + nbytes].view(dtype).view(shape).copy_(t)
        torch.cuda.synchronize(self.device)
        return {"buffer": new, "layout": layout, "skeleton": skeleton}


def shared_copy(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`t` copied (one copy, device-to-host if needed) into a new shared-memory CPU tensor."""
    buf = torch.empty(t.shape, dtype=dtype or t.dtype).share_memory_()
    buf.copy_(t)
    return buf


class ShmTransport:
    """The caller's side on CPU: each rank's images in shared memory (the input itself when it is
    shared already, in the tower's dtype, and a rank takes all of it); outputs arrive shared."""

    def __init__(self, world_size: int, output_device: torch.device):
        self.world_size, self.output_device = world_size, output_device
        self.last_timing: dict[str, float] = {}

    def send_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, assignment: list[list[int]],
                    dtype: torch.dtype) -> list[dict]:
        whole = pixel_values.device.type == "cpu" and pixel_values.is_shared() and pixel_values.dtype == dtype
        payloads = []
        for images in assignment:
            if whole and len(images) == grid_thw.shape[0]:
                payloads.append({"pixel_values": pixel_values})
                continue
            rows = sum(patch_counts(grid_thw[images])) if images else 0
            buffer = torch.empty(rows, *pixel_values.shape[1:], dtype=dtype).share_memory_()
            payloads.append({"pixel_values": pack_for_rank(pixel_values.detach(), grid_thw, images, out=buffer)[0]})
        return payloads

    def read_output(self, rank: int, reply: TowerOutput | None, copy: bool) -> TowerOutput | None:
        if reply is None or (self.output_device.type == "cpu" and not copy):
            return reply
        return reply.map(lambda t: t.to(self.output_device, copy=copy))

    def finish(self) -> None:
        pass


class ShmEndpoint:
    """A worker's side on CPU."""

    def inputs(self, payload: dict) -> torch.Tensor:
        return payload["pixel_values"]

    def reply(self, out: TowerOutput) -> TowerOutput:
        return out.map(shared_copy)


def caller_transport(device_type: str, world_size: int, output_device: torch.device, staging: str = "auto"):
    if device_type == "cuda":
        return CudaTransport(world_size, output_device, staging)
    return ShmTransport(world_size, output_device)


def worker_endpoint(device: torch.device):
    return CudaEndpoint(device) if device.type == "cuda" else ShmEndpoint()
