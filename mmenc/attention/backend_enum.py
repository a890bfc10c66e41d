"""AttentionBackendEnum lives on the ground floor (mmenc.backends.backend_enum); this path stays."""
from mmenc.backends.backend_enum import AttentionBackendEnum

__all__ = ["AttentionBackendEnum"]
