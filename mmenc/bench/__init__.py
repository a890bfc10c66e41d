"""Tooling beside the runtime (the engine imports none of it): throughput measurement (measure.py),
FLOP counting (flops.py), transformers' own towers as the reference (hf_reference.py), and the
benchmark suite's entry point (suite.py: `python -m mmenc.bench.suite --out DIR`)."""
