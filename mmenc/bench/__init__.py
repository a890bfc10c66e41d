"""Tooling beside the runtime (the engine imports none of it): throughput measurement (measure.py),
FLOP counting (flops.py) and transformers' own towers as the reference (hf_reference.py). The suite
that runs the benchmarks is benchmarks/run.py in the repository."""
