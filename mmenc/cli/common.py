"""Flags shared by the subcommands that build an Encoder, derived from MultiModalConfig/Encoder."""
import argparse

from mmenc.attention.backend_enum import AttentionBackendEnum


def add_encoder_args(parser: argparse.ArgumentParser, default_model_help: str) -> None:
    parser.add_argument("--model", default=None, help=f"checkpoint folder or built-in name ({default_model_help})")
    parser.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                        help="dummy: random weights, no files (implied for built-in names)")
    parser.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, float32 on CPU), bfloat16, float16, float32")
    parser.add_argument("--device", default=None, help="torch device (default: the platform's)")
    parser.add_argument("--mm-encoder-attn-backend", default=None, metavar="BACKEND",
                        help="force one attention backend: " + ", ".join(b.name for b in AttentionBackendEnum))
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="number of devices (worker processes) for the tower")
    parser.add_argument("--mm-encoder-tp-mode", choices=["weights", "data"], default="weights",
                        help="weights: shard the tower over the devices; data: one replica per device, images split")
    parser.add_argument("--compile", action="store_true", help="torch.compile the tower's blocks (first call compiles)")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="CUDA only: replay one CUDA graph per packing seen before (the 2nd call of a packing captures)")
    parser.add_argument("--worker-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="with --tensor-parallel-size > 1: the most one call waits for the worker processes "
                             "before they count as hung (default: %(default)s)")


def encoder_kwargs(args: argparse.Namespace, default_model: str) -> dict:
    return dict(model=args.model or default_model, dtype=args.dtype, device=args.device,
                mm_encoder_attn_backend=args.mm_encoder_attn_backend, load_format=args.load_format,
                tensor_parallel_size=args.tensor_parallel_size, mm_encoder_tp_mode=args.mm_encoder_tp_mode,
                compile=args.compile, cuda_graphs=args.cuda_graphs, worker_timeout_s=args.worker_timeout)
