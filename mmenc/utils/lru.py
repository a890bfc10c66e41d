"""A small least-recently-used cache (towers' per-grid plans, rotary tables, the engine's CUDA-graph
sightings)."""
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any


class LRUCache:
    """A small least-recently-used map: `get(key, make)` returns the cached value or `make()`'s."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._data: OrderedDict[Hashable, Any] = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key in self._data:
            self._data.move_to_end(key)
            return self._data[key]
        value = make()
        self._data[key] = value
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)
        return value

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)
