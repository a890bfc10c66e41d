"""Moved to mmenc.shm (the preprocessing worker processes use the same segments and Channel); this
name stays for code written against it."""
from mmenc.shm import Channel, Segment, SegmentPool, raise_fd_limit, socket_pair  # noqa: F401
