"""glibc's malloc as mmenc tunes it for a CPU tower (`cpu_malloc="tuned"`) against as it is ("system").

    python benchmarks/cpu_malloc.py --mode tuned [--layers 4] [--dtype bfloat16] [--calls 36]
    python benchmarks/cpu_malloc.py --mode system ...        # run the two alternately, one process each

The setting is process-wide, so each mode needs its own process. The Qwen2.5-VL-7B tower cut to --layers
blocks (random weights), calls cycling six packings; per call: CPU s, sys s and minor page faults
(getrusage), and the resident memory every six calls. BENCHMARKS.md, "glibc's malloc keeping freed blocks".
"""
import argparse
import json
import os
import resource
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "passive")

import torch  # noqa: E402

from mmenc.bench.measure import cut_model  # noqa: E402
from mmenc.engine.encoder import Encoder  # noqa: E402

GRIDS = [[[1, 74, 74]], [[1, 32, 32]] * 4, [[1, 50, 90]], [[1, 16, 16]] * 9, [[1, 60, 40], [1, 20, 36]], [[1, 88, 88]]]


def rss_mib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    return -1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("tuned", "system"), required=True)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=36)
    args = p.parse_args()
    model = cut_model("Qwen/Qwen2.5-VL-7B-Instruct", args.layers, tempfile.mkdtemp())
    enc = Encoder(model, device="cpu", dtype=args.dtype, load_format="dummy", cpu_malloc=args.mode)
    calls, rss = [], []
    for i in range(args.calls):
        grid = torch.tensor(GRIDS[i % len(GRIDS)])
        px = torch.randn(int(grid.prod(-1).sum()), 1176)
        a = resource.getrusage(resource.RUSAGE_SELF)
        enc.encode_pixels(px, grid)
        b = resource.getrusage(resource.RUSAGE_SELF)
        calls.append({"patches": int(grid.prod(-1).sum()), "cpu_s": round(b.ru_utime + b.ru_stime - a.ru_utime - a.ru_stime, 3),
                      "sys_s": round(b.ru_stime - a.ru_stime, 3), "faults": b.ru_minflt - a.ru_minflt})
        if i % len(GRIDS) == len(GRIDS) - 1:
            rss.append(rss_mib())
    later = calls[len(GRIDS):]  # after each packing's first call
    print(json.dumps({"mode": args.mode, "layers": args.layers, "dtype": args.dtype,
                      "cpu_s_after_first_round": round(sum(c["cpu_s"] for c in later), 2),
                      "faults_after_first_round": sum(c["faults"] for c in later), "rss_mib_every_round": rss}))


if __name__ == "__main__":
    main()
