"""How the service's Batcher calls a loaded Encoder: the tower call, the device-side input step and
the bucketing choice (docs/serving.md, "Keeping the device busy").

On an accelerator tower in this process, the call is `Encoder.launch`: it queues the kernels and
returns without waiting for them (`Encoder.encode_pixels` would wait: its finiteness check reads the
result on the host), so the launcher can queue the next call while this one runs; the completer
checks finiteness after the copy back (`Encoder.check_finite`). Once the service is ready the batcher
is the tower's only caller, so the Encoder's per-call lock it takes is never contended. Elsewhere (CPU,
worker processes, torchrun ranks) it is `Encoder.encode_pixels` itself."""
from collections.abc import Callable

import torch

from mmenc.serving.batcher import Batcher
from mmenc.serving.metrics import ServeMetrics
from mmenc.serving.preprocess import has_per_image_api, normalize_rows
from mmenc.serving.settings import ServeSettings


def asynchronous_tower_call(enc) -> tuple[Callable, Callable] | None:
    """(the tower call without a host sync, check_finite(cpu embeddings, tokens)) for an accelerator
    tower in this process; None elsewhere (worker processes, torchrun ranks, the CPU)."""
    if not enc.launches_asynchronously:
        return None

    def encode(pixel_values: torch.Tensor, grid_thw: torch.Tensor, return_extras: bool = True):
        return enc.launch(pixel_values, grid_thw)

    return encode, enc.check_finite


def use_buckets(settings: ServeSettings, enc) -> bool:
    """bucket_batches "on"/"off", or "auto": on when the Encoder replays CUDA graphs."""
    if settings.bucket_batches == "auto":
        return bool(getattr(enc.mm_config, "cuda_graphs", False))
    return settings.bucket_batches == "on"


def make_batcher(enc, settings: ServeSettings, metrics: ServeMetrics) -> Batcher:
    device = enc.device
    call = asynchronous_tower_call(enc)
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
    return enc.graph_stats if enc.graph_stats() is not None else None
