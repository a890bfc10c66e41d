"""The backend registry lives on the ground floor (mmenc.backends); these names stay here for
plugins written against this path (`register_backend(enum_member, "package.module:Class")`)."""
from mmenc.backends import AttentionBackend, get_backend_class, register_backend, registered_backends

__all__ = ["AttentionBackend", "get_backend_class", "register_backend", "registered_backends"]
