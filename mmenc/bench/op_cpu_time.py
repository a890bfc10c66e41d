"""Process CPU time (user + sys, every thread) per operator: where a CPU tower's time goes on a shared machine.

Wall-clock profiles (torch.profiler) charge an operator for the time other processes held the cores; the
process's own CPU time does not (with OMP_WAIT_POLICY=passive, so that waiting threads sleep instead of
spinning). `OpCpuTime` is a TorchDispatchMode: every aten/custom operator call is bracketed by
getrusage(RUSAGE_SELF), so an operator's intra-op threads count towards it.

    with OpCpuTime() as ops:
        tower(pixel_values, grid_thw)
    print(ops.table())          # total, then the operators by CPU seconds: calls, seconds, share

Imports torch only: the vLLM benchmark child (vllm_child.py, run by another interpreter) imports it by path.
"""
import collections
import resource

from torch.utils._python_dispatch import TorchDispatchMode


def process_cpu_seconds() -> float:
    """User + system CPU seconds of this process so far, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class OpCpuTime(TorchDispatchMode):
    """CPU seconds and call counts per operator (its overload packet's name, e.g. "aten.mul")."""

    def __init__(self):
        super().__init__()
        self.stats: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])  # name -> [calls, seconds]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = process_cpu_seconds()
        out = func(*args, **(kwargs or {}))
        entry = self.stats[str(func.overloadpacket)]
        entry[0] += 1
        entry[1] += process_cpu_seconds() - start
        return out

    def total(self) -> float:
        return sum(seconds for _, seconds in self.stats.values())

    def as_dict(self) -> dict[str, dict]:
        """{name: {"calls": n, "cpu_s": s}}, the most expensive first."""
        rows = sorted(self.stats.items(), key=lambda kv: -kv[1][1])
        return {name: {"calls": calls, "cpu_s": seconds} for name, (calls, seconds) in rows}

    def table(self, rows: int = 15) -> str:
        total = self.total() or 1e-12
        lines = [f"{'operator':40s} {'calls':>6s} {'cpu s':>8s} {'share':>6s}"]
        for name, entry in list(self.as_dict().items())[:rows]:
            lines.append(f"{name:40s} {entry['calls']:6d} {entry['cpu_s']:8.3f} {100 * entry['cpu_s'] / total:5.1f}%")
        return "\n".join(lines + [f"{'total':40s} {'':6s} {total:8.3f}"])
