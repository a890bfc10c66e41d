"""How the service's Batcher calls a loaded Encoder: the tower call, the device-side input step and
the bucketing choice (docs/serving.md, "Keeping the device busy").

On a CUDA tower in this process, the call is the runner's own `run`: it queues the kernels and
returns without waiting for them (`Encoder.encode_pixels` would wait: its finiteness check reads the
result on the host), so the launcher can queue the next call while this one runs; the completer
checks finiteness after the copy back. Once the service is ready the batcher is the tower's only
caller, so the Encoder's per-call lock is not needed there. Elsewhere (CPU, worker processes,
calls over the Encoder's max_batch_patches) it is `Encoder.encode_pixels` itself."""
from collections.abc import Callable

import torch

from mmenc.engine.checks import check_finite
from mmenc.engine.executors import InProcessExecutor
from mmenc.serving.batcher import Batcher
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.preprocess import has_per_image_api, normalize_rows
from mmenc.serving.settings import ServeSettings


def asynchronous_tower_call(enc) -> tuple[Callable, Callable] | None:
    """(encode_pixels without a host sync, check_finite(cpu embeddings, tokens)) for an in-process
    tower; None for worker processes or torchrun ranks."""
    if not isinstance(enc.runner, InProcessExecutor):
        return None

    def encode(pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_extras: bool = True):
        if int(grid_thw[:, :3].prod(-1).sum()) > enc.max_batch_patches:
            return enc.encode_pixels(pixel_values, grid_thw, return_extras=True)  # split into several calls
        with torch.inference_mode():
            return enc.runner.run(pixel_values, grid_thw)

    return encode, lambda embeddings, tokens: check_finite(embeddings, tokens, enc.strict)


def use_buckets(settings: ServeSettings, enc) -> bool:
    """bucket_batches "on"/"off", or "auto": on when the Encoder replays CUDA graphs."""
    if settings.bucket_batches == "auto":
        return bool(getattr(enc.mm_config, "cuda_graphs", False))
    return settings.bucket_batches == "on"


def make_batcher(enc, settings: ServeSettings, metrics: ServeMetrics) -> Batcher:
    device = enc.device
    call = asynchronous_tower_call(enc) if device.type != "cpu" else None
    encode, finite = call if call is not None else (enc.encode_pixels, None)
    processor = enc.processor
    # uint8 jobs pay off where the batch crosses to a device; on the CPU, normalizing in the pool
    # threads (float jobs) keeps that work off the launcher
    uint8 = has_per_image_api(processor) and device.type != "cpu"
    prepare = (lambda patches: normalize_rows(processor, patches)) if uint8 else None
    return Batcher(encode, enc.output_tokens, settings.max_batch_patches, settings.max_wait_ms, metrics,
                   pin_memory=device.type == "cuda", device=device, prepare=prepare, check_finite=finite,
                   bucket=use_buckets(settings, enc), max_in_flight=settings.max_in_flight,
                   graph_stats=_graph_stats(enc))


def _graph_stats(enc) -> Callable[[], dict] | None:
    graphs = getattr(getattr(enc, "loaded", None), "graphs", None)
    return (lambda: dict(graphs.stats)) if graphs is not None else None
