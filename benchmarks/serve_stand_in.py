"""A near-free stand-in tower, to measure what the host side of `mmenc serve` can carry (bench only).

The real server (HTTP, routes, preprocessing, batcher, rendering) runs over a real Encoder built
from a small checkpoint, whose tower is swapped for `StandInTower`: it keeps the checkpoint's
processor and token counts (Qwen2.5-VL: a 448x448 image -> 1024 patches -> 256 tokens) and answers
[tokens, hidden] bfloat16 (hidden 3584 by default: Qwen2.5-VL-7B's, 1.8 MB per 448px image) without
running a model. Every row is one fixed small vector except column 0, which is the mean of the
first patch of each merged token, so each answer can be checked against an offline one. The
batcher gets uint8 jobs as on a GPU (decode, resize and patchify in the pool; the stand-in
normalizes only the rows it reads), so the host work per image is the GPU server's.

Launcher probe: each stand-in call first runs `probe_ops` tiny torch ops (each releases and takes
back the GIL, as a launcher's kernel launches do) and records how long they took in the metric
`mmenc_standin_probe_seconds`: alone they take well under a millisecond; what the call takes beyond
that is time the launcher waited for the GIL held by the server's other threads.

    python benchmarks/serve_stand_in.py --stand-in-hidden 3584 serve --model DIR --device cpu --port 8000 ...

(`DIR`: e.g. mmenc.testing.checkpoints.save_qwen2_5_vl(folder)). benchmarks/serve_load.py
--stand-in-tower HIDDEN starts this instead of `mmenc serve` and encodes its references with it.
"""
import argparse
import sys
import time

import torch
from torch import nn

from mmenc.models.base import TowerOutput
from mmenc.serving.preprocess import normalize_rows


class StandInTower(nn.Module):
    """(pixel_values [P, F] float, or uint8 patches [P, *row_shape], grid_thw [N, 3]) ->
    TowerOutput(embeddings bf16 [P / merge**2, hidden]); output_tokens as the replaced tower's."""

    def __init__(self, replaced: nn.Module, processor, hidden: int, probe_ops: int = 200):
        super().__init__()
        self.probe_ops, self.probe_seconds = probe_ops, None  # a Histogram, set by stand_in_batcher
        merge = getattr(replaced.config, "spatial_merge_size", None)
        if merge is None:
            raise ValueError(f"the stand-in needs a tower with spatial_merge_size (Qwen-VL family); "
                             f"{type(replaced.config).__name__} has none")
        self.merge, self.processor, self.replaced = merge * merge, processor, replaced
        generator = torch.Generator().manual_seed(0)
        self.row = (torch.randn(hidden, generator=generator) * 1e-3).to(torch.bfloat16)

    def output_tokens(self, grid_thw: torch.Tensor) -> list[int]:
        return self.replaced.output_tokens(grid_thw)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> TowerOutput:
        start, x = time.perf_counter(), self.row[:8]
        for _ in range(self.probe_ops):
            x = x * 1.0
        if self.probe_seconds is not None:
            self.probe_seconds.observe(time.perf_counter() - start)
        first = pixel_values[::self.merge].contiguous()  # the first patch of each merged token
        if not first.is_floating_point():  # the batcher's uint8 jobs: normalize just these rows
            first = normalize_rows(self.processor, first.reshape(first.shape[0], *self.processor.row_shape))
        signature = first.reshape(first.shape[0], -1).to(torch.bfloat16).float().mean(1)  # [tokens]
        out = torch.empty(first.shape[0], self.row.numel(), dtype=torch.bfloat16)
        out.copy_(self.row.expand_as(out))
        out[:, 0] = signature
        return TowerOutput(out)


def stand_in_encoder(hidden: int, **encoder_kwargs):
    """An Encoder (CPU, in this process) whose tower is a StandInTower of width `hidden`."""
    from mmenc.engine.encoder import Encoder

    enc = Encoder(**encoder_kwargs)
    if enc.device.type != "cpu" or enc.tensor_parallel_size != 1:
        raise ValueError(f"the stand-in tower runs on the CPU in one process; got device {enc.device}, "
                         f"tensor_parallel_size {enc.tensor_parallel_size}: pass --device cpu")
    enc.replace_tower(StandInTower(enc.tower, enc.processor, hidden), dtype=torch.bfloat16)
    return enc


def stand_in_batcher(enc, settings, metrics):
    """The service's Batcher over the stand-in: uint8 jobs, no device step (as a CUDA tower's host side)."""
    from mmenc.serving.batcher import Batcher
    from mmenc.serving.launch import use_buckets

    from prometheus_client import Histogram

    tower = enc.tower
    tower.probe_seconds = Histogram("mmenc_standin_probe_seconds", f"{tower.probe_ops} tiny torch ops at the "
                                    "start of each stand-in call (GIL waits of a launcher)", registry=metrics.registry)

    def encode(pixel_values, grid_thw, return_extras=True):
        return tower(pixel_values, grid_thw)

    return Batcher(encode, enc.output_tokens, settings.max_batch_patches, settings.max_wait_ms, metrics,
                   device="cpu", prepare=lambda patches: patches, bucket=use_buckets(settings, enc),
                   max_in_flight=settings.max_in_flight)


def main(argv=None) -> int:
    from mmenc.cli import serve as serve_cli
    from mmenc.cli.common import encoder_kwargs
    from mmenc.engine.encoder import DEFAULT_MODEL
    from mmenc.serving.server import serve

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stand-in-hidden", type=int, default=3584, help="embedding width (default: %(default)s)")
    serve_cli.add_parser(p.add_subparsers(dest="command", required=True))
    args = p.parse_args(argv)
    settings = serve_cli.settings_from_args(args)
    kwargs = encoder_kwargs(args, DEFAULT_MODEL)
    return serve(settings, lambda: stand_in_encoder(args.stand_in_hidden, **kwargs), batcher_factory=stand_in_batcher)


if __name__ == "__main__":
    sys.exit(main())
