"""Keys and the encoder cache: an LRU of EncodedImage bounded by bytes, safe to use from threads."""
import collections
import dataclasses
import hashlib
import threading

from mmenc.serving.formats import EncodedImage


def content_key(identity: bytes, data: bytes) -> str:
    """sha256 hex of (model and processor identity, image file bytes): the key of an image sent
    without a uuid. `identity` comes from `model_identity`."""
    h = hashlib.sha256()
    h.update(len(identity).to_bytes(8, "little"))
    h.update(identity)
    h.update(data)
    return h.hexdigest()


def model_identity(model_name: str, processor, dtype) -> bytes:
    """What makes two servers' embeddings of the same bytes equal: model, processor config, dtype."""
    config = getattr(processor, "config", None)
    return repr((model_name, type(processor).__name__, repr(config), str(dtype))).encode()


@dataclasses.dataclass(frozen=True)
class CacheStats:
    """Counters of a cache shared by several servers (mmenc.ray.shared_cache): lookups answered (by any
    tier) and not, what it holds, and the hits its shared tier gave (a repeat that another replica encoded)."""

    hits: int
    misses: int
    nbytes: int
    entries: int
    shared_hits: int = 0


class EncoderCache:
    """LRU of key -> EncodedImage, evicting the least recently used entries beyond `max_bytes`
    (0 disables it: every get misses, put stores nothing). An entry larger than the whole cache is
    not stored."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: collections.OrderedDict[str, EncodedImage] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> EncodedImage | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def lookup(self, key: str) -> EncodedImage | None:
        """A request's lookup (the service counts it): `get`. A tiered cache counts these itself."""
        return self.get(key)

    def put(self, key: str, value: EncodedImage) -> None:
        """Store (None: done; a tiered cache returns a Future done once its other tier has it)."""
        size = value.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._entries[key] = value
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)
