"""The bottom floor: small helpers every floor may use, importing nothing of mmenc.

    device_copy.py   to_device: a host tensor on a device without a host wait (pinned, asynchronous)
    lru.py           LRUCache: a small least-recently-used map

Import each name from its module (one path per name); this package exports nothing itself.
"""
