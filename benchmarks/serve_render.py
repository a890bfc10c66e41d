"""Per-image cost of rendering a "vllm" answer (torch.save + base64) and what it does to a thread that
launches tower calls: the first path (torch.save, one standard-library base64 call, joined) vs the
service's (`TensorSaver.save_pieces` + `mmenc.serving.b64`: pybase64 when installed, each piece
encoded where it lies, not joined).

    python benchmarks/serve_render.py --tokens 256 --hidden 3584 --threads 4

render ms: one image, one thread (best of 7 rounds; CPU time of the thread, so other load on the
machine counts little). launcher ms: a loop of 200 small torch ops (a stand-in for launching a tower
call: each op releases and takes back the GIL) while `threads` threads render images non-stop;
alone vs beside each rendering path (median of 30 loops)."""
import argparse
import base64
import io
import statistics
import threading
import time

import torch

from mmenc.serving import b64
from mmenc.serving.b64 import b64encode
from mmenc.serving.tensor_bytes import TensorSaver


def old_render(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return b"".join([b'{"x":"', base64.b64encode(buf.getbuffer()), b'"}'])


def best_ms(fn, n: int = 10, rounds: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(n):
            fn()
        best = min(best, (time.thread_time() - start) / n * 1000)
    return best


def launcher_ms(loops: int = 30) -> float:
    x = torch.ones(64)
    times = []
    for _ in range(loops):
        start = time.perf_counter()
        for _ in range(200):
            x = x * 1.0
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def beside(render, t: torch.Tensor, threads: int) -> float:
    stop = threading.Event()

    def work():
        while not stop.is_set():
            render(t)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    for w in workers:
        w.start()
    time.sleep(0.2)
    try:
        return launcher_ms()
    finally:
        stop.set()
        for w in workers:
            w.join()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=3584)
    p.add_argument("--threads", type=int, default=4)
    args = p.parse_args()
    t = torch.randn(args.tokens, args.hidden).to(torch.bfloat16)
    saver = TensorSaver()
    new_render = lambda x: [b64encode(piece) for piece in saver.save_pieces(x)]  # noqa: E731
    whole = b"".join(new_render(t))
    assert torch.equal(torch.load(io.BytesIO(base64.b64decode(whole)), weights_only=True), t)
    print(f"tensor {tuple(t.shape)} bf16 = {t.numel() * 2 / 1e6:.2f} MB; base64 by {b64.encoder_name()}")
    fast = b64._fast
    b64._fast = None
    stdlib_ms = best_ms(lambda: new_render(t))
    b64._fast = fast
    print(f"render ms/image  old {best_ms(lambda: old_render(t)):.2f}  new {best_ms(lambda: new_render(t)):.2f}"
          f"  (new with the standard library's base64: {stdlib_ms:.2f})")
    print(f"  torch.save {best_ms(lambda: torch.save(t, io.BytesIO())):.2f}"
          f"  save_pieces {best_ms(lambda: saver.save_pieces(t)):.2f}")
    print(f"launcher ms (200 ops)  alone {launcher_ms():.2f}  beside old {beside(old_render, t, args.threads):.2f}"
          f"  beside new {beside(new_render, t, args.threads):.2f}")


if __name__ == "__main__":
    main()
