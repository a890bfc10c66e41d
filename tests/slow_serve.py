"""`mmenc serve` over a CPU Encoder whose every tower call first keeps torch busy for SLOW_S seconds
(as a large call on a slow device would): the shutdown tests' server, started as a real process.
    python tests/slow_serve.py MODEL SLOW_S -- <mmenc serve flags>"""
import sys
import time

import torch


def slow_encoder(model: str, slow_s: float):
    from mmenc.engine.encoder import Encoder

    enc = Encoder(model, device="cpu")
    encode_pixels = enc.encode_pixels

    def slow(*args, **kwargs):
        x, end = torch.randn(128, 128), time.time() + slow_s
        while time.time() < end:
            x = (x @ x).tanh()
        return encode_pixels(*args, **kwargs)

    enc.encode_pixels = slow  # the batcher's tower call on the CPU
    return enc


def main() -> int:
    from mmenc.cli.main import build_parser
    from mmenc.cli.serve import settings_from_args
    from mmenc.serving.server import serve

    model, slow_s = sys.argv[1], float(sys.argv[2])
    args = build_parser().parse_args(["serve", *sys.argv[4:]])
    return serve(settings_from_args(args), lambda: slow_encoder(model, slow_s))


if __name__ == "__main__":
    sys.exit(main())
