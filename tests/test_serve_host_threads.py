"""mmenc.serving.host_threads: a service process whose tower is not on this CPU runs torch's CPU ops on one
intra-op thread (its pool threads are the parallelism); a CPU tower keeps its threads. Each case in a fresh
process, since the setting is process-wide."""
import subprocess
import sys

import pytest

CASE = """
import torch
from mmenc.serving.host_threads import one_intra_op_thread
torch.set_num_threads(2)
changed = one_intra_op_thread({device!r}, "test")
print(changed, torch.get_num_threads())
"""


@pytest.mark.parametrize("device, want", [("cuda", "True 1"), (None, "True 1"), ("cpu", "False 2")])
def test_one_intra_op_thread_unless_the_tower_is_on_the_cpu(device, want):
    out = subprocess.run([sys.executable, "-c", CASE.format(device=device)], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.split("\n")[-2] == want, out.stdout + out.stderr
