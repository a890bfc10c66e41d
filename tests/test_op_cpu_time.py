"""mmenc.bench.op_cpu_time: CPU seconds per operator, the profile benchmarks/cpu_bench.py --op-profile prints."""
import torch

from mmenc.bench.op_cpu_time import OpCpuTime, process_cpu_seconds


def test_counts_each_operator_and_charges_its_cpu_time():
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    with OpCpuTime() as ops:
        for _ in range(3):
            c = a @ b
        c.add_(1.0)
    stats = ops.as_dict()
    assert stats["aten.mm"]["calls"] == 3 and stats["aten.add_"]["calls"] == 1
    assert stats["aten.mm"]["cpu_s"] > 0  # 3 x 0.27 GFLOP: well above getrusage's resolution
    assert list(stats)[0] == "aten.mm", f"the matmuls should cost the most: {stats}"
    assert abs(ops.total() - sum(e["cpu_s"] for e in stats.values())) < 1e-9
    table = ops.table()
    assert "aten.mm" in table and "total" in table.splitlines()[-1]


def test_outputs_unchanged_under_the_mode():
    a, b = torch.randn(64, 32), torch.randn(32, 16)
    with OpCpuTime():
        c = torch.nn.functional.gelu(a @ b)
    assert torch.equal(c, torch.nn.functional.gelu(a @ b))
    assert process_cpu_seconds() > 0
