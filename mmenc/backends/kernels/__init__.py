"""mmenc's own kernels (TRITON_ATTN's). Each module imports its optional compiler (triton) itself,
so importing this package never fails; use the backends (mmenc.backends) rather than these directly."""
