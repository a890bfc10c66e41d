"""Test and benchmark tooling, not part of the runtime: tiny random-weight checkpoints written with
transformers (`mmenc.testing.checkpoints`), the per-family table the generic tower tests read, and
helpers to compare tower outputs. Importing it needs only torch; transformers is imported on use."""
