"""The Encoder's surface for tools and the service (docs/engine.md, "For tools and the service").

Serving, Ray, the benchmarks and the CLI use these instead of the Encoder's insides: `launch` (the
service's tower call, no finite check), `call_lock`, `input_device`, `launches_asynchronously`, `dtype`,
`tower` and `loaded` (what describes the tower), the CUDA graphs (`graph_stats`, `unreplayed_graphs`,
`graph_recent_calls`, `configure_graphs`, `clear_graphs`, `graphs_off`), `tower_call_hook` (tracing) and
stand-ins (`replace_tower`, `replace_preprocessor`). Here too is the tower-call path they act on
(`_run`, `_run_chunks`), which encode, encode_iter and encode_pixels take as well.

ToolSurface is a part of mmenc.engine.encoder.Encoder, not a class of its own: it uses the Encoder's
state (`_executor`, `_loaded`, `_lock`, `_hooks`, `_graphs_off`, `preprocessor`, `processor`,
`settings`, `strict`, `tensor_parallel_size`, `max_batch_patches`, `_check_open`).
"""
import contextlib
import threading
from collections.abc import Sequence

import torch

from mmenc.engine.checks import check_finite
from mmenc.engine.outputs import concat_outputs, whole_image_runs
from mmenc.engine.tower import LoadedTower
from mmenc.models.base import TowerOutput
from mmenc.preprocess.pipeline import Preprocessor


class ToolSurface:
    """The Encoder's methods for tools and the service (see the module docstring)."""

    @property
    def call_lock(self) -> threading.Lock:
        """The lock each tower call holds (encode_pixels, encode's chunks, embed_text): a caller that drives
        the runner itself (the service's batcher on CUDA) holds it too, so a text call never runs beside
        a tower call (nor beside a CUDA graph capture)."""
        return self._lock

    @property
    def loaded(self) -> LoadedTower:
        """What describes the tower (mmenc.engine.tower.LoadedTower: model, spec, hf_config, config,
        preprocessor_config, video_config, dtype, device, load_format, folder), for tools that build a peer
        of it (mmenc.bench.hf_reference.build_hf_tower) or read its checkpoint's settings. Read only: the
        tower changes through replace_tower, its CUDA graphs (`graphs`, the engine's) through
        configure_graphs, clear_graphs and graphs_off."""
        return self._loaded

    @property
    def input_device(self) -> torch.device:
        """Where `launch`'s pixel_values should be (the tower's device; the CPU with worker processes,
        which stage host pixels to their GPUs themselves)."""
        return self._executor.input_device

    @property
    def launches_asynchronously(self) -> bool:
        """Whether `launch` returns as soon as the tower's kernels are queued (a tower on an accelerator in
        this process); False with worker processes, torchrun ranks and on the CPU, where it returns done."""
        return self._executor.launches_asynchronously and self.device.type != "cpu"

    @property
    def dtype(self) -> torch.dtype:
        """The tower's dtype: its weights', its outputs', and what `launch` casts pixel_values to."""
        return self.loaded.dtype

    @property
    def tower(self) -> torch.nn.Module:
        """The tower module in this process (mmenc.models.base.VisionTower: `config`, `modules()`,
        `load_weights`), for tools that set its layers' knobs, hook them or load weights into them. With
        worker processes it is a meta-device copy that answers shape questions only (the workers hold
        the weights)."""
        return self.loaded.tower

    def replace_tower(self, tower: torch.nn.Module, dtype: torch.dtype | None = None) -> None:
        """From now on run `tower(pixel_values, grid_thw) -> TowerOutput` in place of the built tower, without
        CUDA graphs (a benchmark's stand-in); dtype: what pixel_values are cast to and what `dtype` says
        (default: unchanged). Only for a tower in this process: ValueError with worker processes or torchrun."""
        if self.tensor_parallel_size != 1:
            raise ValueError(f"replace_tower: the tower runs in {self.tensor_parallel_size} processes "
                             f"(tensor_parallel_size={self.tensor_parallel_size}); use tensor_parallel_size=1")
        with self._lock:
            self.loaded.tower, self.loaded.graphs = tower, None
            if dtype is not None:
                self.loaded.dtype = dtype

    def replace_preprocessor(self, workers: int | None = None, decode: str = "auto") -> None:
        """From now on preprocess with `workers` decode/resize workers (None: one per usable core) and
        `decode` (mmenc.preprocess.placement), keeping the worker kind and resize place the Encoder chose,
        its video processor and its 16-bit handling (`mmenc bench --e2e` or `--video` with
        `--preprocess-workers N`). The old workers are closed; call it between encodes."""
        old = self.preprocessor
        self.preprocessor = Preprocessor(self.processor, device=old.device, workers=workers, decode=decode,
                                         worker_kind=old.worker_kind, resize=old.resize,
                                         video_processor=self.video_processor,
                                         high_bit_depth=self.settings.high_bit_depth)
        old.close()

    @torch.inference_mode()
    def launch(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        """The tower call(s) for pixel_values [P, F] (on `input_device`) and grid_thw int64 [N >= 1, 3] (CPU),
        under the Encoder's lock, returned without reading the result on the host: on CUDA the kernels are
        queued and the TowerOutput's tensors are filled in stream order. No finite check (that reads the
        result): call `check_finite(out.embeddings, enc.output_tokens(grid_thw))` once it is read back.
        More than max_batch_patches patches run as several calls over whole images. The service's
        batcher calls this; everyone else wants `encode_pixels`."""
        self._check_open("launch")
        with self._lock:
            return self._run_chunks(pixel_values, grid_thw)

    def check_finite(self, embeddings: torch.Tensor, tokens: Sequence[int]) -> None:
        """Warn (or under strict=True raise NonFiniteOutputError) naming the images whose embeddings
        [sum tokens, hidden] hold NaN or inf; reads them on the host."""
        check_finite(embeddings, tokens, self.strict)

    def graph_stats(self) -> dict[str, int] | None:
        """The CUDA-graph cache's tower calls so far by outcome (replays, captures, eager; and stale,
        replanned, dropped_unreplayed, ...: mmenc.engine.cuda_graphs), or None without CUDA graphs
        (cuda_graphs=False, worker processes)."""
        graphs = self._graphs()
        return None if graphs is None else dict(graphs.stats)

    def unreplayed_graphs(self) -> int:
        """CUDA graphs captured so far and never replayed (kept or dropped); 0 without CUDA graphs."""
        graphs = self._graphs()
        return 0 if graphs is None else graphs.unreplayed()

    @property
    def graph_recent_calls(self) -> int | None:
        """The capture rule in force (configure_graphs' recent_calls), or None: capture whenever a packing
        comes again, or no CUDA graphs (graph_stats() is None)."""
        graphs = self._graphs()
        return None if graphs is None else graphs.recent_calls

    def configure_graphs(self, recent_calls: int | None) -> None:
        """Capture a packing only when it was seen again within `recent_calls` tower calls (None: whenever
        seen twice; see mmenc.engine.cuda_graphs). ValueError without CUDA graphs or for recent_calls < 1."""
        graphs = self._graphs()
        if graphs is None:
            raise ValueError(f"configure_graphs(recent_calls={recent_calls}): this Encoder has no CUDA graphs "
                             f"(cuda_graphs=True, a CUDA device and tensor_parallel_size=1 give them)")
        if recent_calls is not None and recent_calls < 1:
            raise ValueError(f"recent_calls={recent_calls} must be >= 1 (or None: capture whenever a packing "
                             f"comes again)")
        graphs.recent_calls = recent_calls

    def clear_graphs(self) -> None:
        """Drop every captured CUDA graph (and its memory pool) and the sightings; no-op without graphs."""
        graphs = self._graphs()
        if graphs is not None:
            graphs.clear()

    @contextlib.contextmanager
    def graphs_off(self):
        """Inside the block the tower runs without its CUDA graphs (eager, or compiled); captured graphs
        stay for after it."""
        self._graphs_off += 1
        try:
            yield
        finally:
            self._graphs_off -= 1

    @contextlib.contextmanager
    def tower_call_hook(self, hook):
        """Inside the block every tower call (of encode, encode_iter, encode_pixels, launch) goes through
        `hook(run, pixel_values, grid_thw) -> TowerOutput`, which must call `run(pixel_values, grid_thw)`
        and return its result (tracing: time it, count it). Hooks nest: the one entered first runs
        closest to the tower. Called under the Encoder's lock, in the thread making the call."""
        self._hooks.append(hook)
        try:
            yield
        finally:
            self._hooks.remove(hook)

    # -- the tower call path ----------------------------------------------------------------------
    def _graphs(self):
        """The tower's CudaGraphCache, or None (no CUDA graphs; worker processes keep theirs)."""
        return getattr(self.loaded, "graphs", None)

    def _run(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        """One tower call through the hooks (under the lock)."""
        run = self._executor.run
        if self._graphs_off:
            run = self._without_graphs(run)
        for hook in self._hooks:
            run = (lambda inner, h: lambda pv, g: h(inner, pv, g))(run, hook)
        return run(pixel_values, grid_thw)

    def _without_graphs(self, run):
        def call(pixel_values, grid_thw):
            graphs, self.loaded.graphs = self.loaded.graphs, None
            try:
                return run(pixel_values, grid_thw)
            finally:
                self.loaded.graphs = graphs
        return call

    def _run_chunks(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        """The tower over runs of whole images of at most max_batch_patches patches (under the lock)."""
        outputs = [self._run(pv, g) for pv, g in whole_image_runs(pixel_values, grid_thw, self.max_batch_patches)]
        return outputs[0] if len(outputs) == 1 else concat_outputs(outputs)
