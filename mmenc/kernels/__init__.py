"""mmenc's own kernels. Each module imports its optional compiler (triton) itself, so importing
this package never fails; use the attention backends rather than these modules directly."""
