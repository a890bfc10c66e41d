"""Throughput of a tower on fixed workloads, side by side with Hugging Face transformers.

Each workload is a list of grids (t, h, w) in patches; inputs are fresh random pixel values.
Timing: warm-up calls, then `iters` calls timed one by one (CUDA events on GPU, perf_counter on
CPU); the median is reported. The floor is the workload's matmul FLOPs over the bf16 matmul rate
measured in the same run. Peak memory: max_memory_allocated over the timed calls; a CUDA-graph replay
allocates nothing, so a graphed call's peak adds the graph pool it holds (call_peak_gib).
"""
import dataclasses
import json
import pathlib
import statistics
import time
from collections.abc import Callable

import torch

from mmenc.models.registry import get_builtin_config

WORKLOADS: dict[str, list[tuple[int, int, int]]] = {
    "8x1036px": [(1, 74, 74)] * 8,
    "32x448px": [(1, 32, 32)] * 32,
    # SigLIP so400m/14 at 384 px (27x27 patches), a dense [32, 729] batch
    "siglip-32x384px": [(1, 27, 27)] * 32,
    # CLIP ViT-L/14 at 336 px (24x24 patches + the class token), dense batches of 32 and 256 (issue 31)
    "clip-32x336px": [(1, 24, 24)] * 32,
    "clip-256x336px": [(1, 24, 24)] * 256,
    # SigLIP2 NaFlex, patch 16: the processor's grids for 4:3, 3:4, 16:9, 9:16, 1:1, 1:2, 2:1, 3:1 photos at
    # max_num_patches 256 and 1024 (mmenc.preprocess.siglip.naflex_size), 4 of each
    "naflex256-mix-32": [(1, 14, 18), (1, 18, 14), (1, 12, 21), (1, 21, 12), (1, 16, 16), (1, 11, 22), (1, 22, 11),
                         (1, 9, 27)] * 4,
    "naflex1024-mix-32": [(1, 27, 36), (1, 36, 27), (1, 24, 42), (1, 42, 24), (1, 32, 32), (1, 22, 44),
                          (1, 44, 22), (1, 18, 54)] * 4,
    # native-resolution towers (Pixtral, SigLIP2 NaFlex): 8 images of mixed aspect ratios, longest side 64
    # patches (1024 px at patch 16): square, 4:3, 3:4, 16:9, 9:16, 2.3:1, and two smaller squares
    "8xmixed-aspect": [(1, 64, 64), (1, 64, 48), (1, 48, 64), (1, 64, 36), (1, 36, 64), (1, 64, 28), (1, 44, 44),
                       (1, 32, 32)],
    # OCR towers: 8 document pages of ~1000x1400 px as their processors size them (patch 14, factor 28:
    # 1008x1400 -> 72x100 patches; GLM-OCR, PaddleOCR-VL, ERNIE-4.5-VL) and (patch 16, factor 32:
    # 992x1408 -> 62x88 patches; HunyuanOCR)
    "8xpage-p14": [(1, 72, 100)] * 8,
    "8xpage-p16": [(1, 62, 88)] * 8,
}


def parse_grid_spec(spec: str) -> list[tuple[int, int, int]]:
    """"1x74x74*8" -> 8 grids of (1, 74, 74); "1x32x32" -> one grid."""
    grid, _, count = spec.partition("*")
    try:
        dims = tuple(int(x) for x in grid.lower().split("x"))
        n = int(count) if count else 1
    except ValueError:
        dims, n = (), 0
    if len(dims) != 3 or min(dims, default=0) < 1 or n < 1:
        raise ValueError(f"grid spec {spec!r} is not valid; expected TxHxW[*COUNT] in patches, e.g. 1x74x74*8")
    return [dims] * n


@dataclasses.dataclass
class BenchRow:
    workload: str
    impl: str
    images: int
    patches: int
    ms: float
    peak_gib: float | None  # max_memory_allocated during the timed calls
    gflop: float
    graph_pool_gib: float | None = None  # see graph_pool_free_bytes: add it to peak_gib for a graphed call

    @property
    def images_per_s(self) -> float:
        return self.images / (self.ms / 1e3)

    @property
    def patches_per_s(self) -> float:
        return self.patches / (self.ms / 1e3)


def time_ms(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Median milliseconds of `fn` after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(name: str, impl: str, fn: Callable[[], object], grids, device: torch.device, warmup: int,
            iters: int, gflop: float) -> BenchRow:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ms = time_ms(fn, device, warmup, iters)
    peak = pool = None
    if device.type == "cuda":
        peak, pool = torch.cuda.max_memory_allocated(device) / 2**30, graph_pool_free_bytes(device) / 2**30
    patches = sum(t * h * w for t, h, w in grids)
    return BenchRow(name, impl, len(grids), patches, ms, peak, gflop, pool)


def graph_pool_free_bytes(device: torch.device) -> int:
    """Bytes held by CUDA-graph memory pools beyond their live tensors: a replayed graph's working memory.
    A replay allocates nothing, so max_memory_allocated leaves it out; a graphed call's peak is
    peak_gib + graph_pool_gib (that pool is still held, unused, while another implementation is timed)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] - seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device", index) == index and tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0))


def call_peak_gib(row: "BenchRow") -> float | None:
    """A row's peak memory: peak_gib, plus the graph pool for a graphed mmenc call ("+graphs" in its label)."""
    if row.peak_gib is None:
        return None
    return row.peak_gib + ((row.graph_pool_gib or 0.0) if "+graphs" in row.impl else 0.0)


def matmul_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Measured dense matmul rate (TFLOP/s) on random data: 8192^3 on GPU, 1024^3 on CPU."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = time_ms(lambda: a @ b, device, warmup=3, iters=10)
    return 2 * n**3 / (ms / 1e3) / 1e12


def random_pixels(grids, channels: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    patches = int(grid_thw.prod(-1).sum())
    return torch.randn(patches, channels, device=device, dtype=dtype), grid_thw


def format_table(rows: list[BenchRow], floor_tflops: float | None) -> str:
    head = f"{'workload':<12} {'impl':<26} {'ms':>9} {'img/s':>8} {'patches/s':>10} {'peak GiB':>8} {'floor %':>7} {'vs HF':>6}"
    lines = [head, "-" * len(head)]
    hf = {r.workload: r for r in rows if r.impl.startswith("transformers")}
    for r in rows:
        floor = f"{100 * (r.gflop / 1e3 / floor_tflops) / (r.ms / 1e3):.0f}" if floor_tflops and r.gflop else "-"
        base = hf.get(r.workload)
        ratio = f"{base.ms / r.ms:.2f}x" if base is not None and base is not r else "-"
        peak = f"{call_peak_gib(r):.2f}" if r.peak_gib is not None else "-"
        lines.append(f"{r.workload:<12} {r.impl:<26} {r.ms:>9.2f} {r.images_per_s:>8.1f} {r.patches_per_s:>10.0f} "
                     f"{peak:>8} {floor:>7} {ratio:>6}")
    return "\n".join(lines)


def cut_model(model: str, layers: int | None, folder: str) -> str:
    """`model`, or with `layers` a config-only folder of it with the first `layers` blocks (load_format="dummy")."""
    if layers is None:
        return model
    config = json.loads(json.dumps(get_builtin_config(model)[1]))
    vision = config["vision_config"]
    if "depth" in vision:  # Qwen2.5-VL
        vision["depth"] = layers
        vision["fullatt_block_indexes"] = [i for i in vision["fullatt_block_indexes"] if i < layers] or [layers - 1]
    else:
        vision["num_hidden_layers"] = layers
    pathlib.Path(folder, "config.json").write_text(json.dumps(config))
    return folder
