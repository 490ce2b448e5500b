"""The host tier: LRU copies of adapter weights in host memory (pinned memory on CUDA).

At most `capacity` copies. Inserting over capacity evicts the least recently used copy
that is not pinned, preferring copies outside the caller's `keep` set (adapters that
waiting requests need soon). An adapter evicted from here is read again from disk when a
request needs it (see loader.py).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

from engine.errors import CapacityError


class HostCache:
    def __init__(self, capacity: int, pinned: set[int]):
        assert capacity >= 1, capacity
        self.capacity = capacity
        self.pinned = pinned  # shared with the slot table
        self._copies: OrderedDict[int, Any] = OrderedDict()  # adapter id -> weights, LRU first

    def __contains__(self, adapter_id: int) -> bool:
        return adapter_id in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def get(self, adapter_id: int):
        """The host copy (marked most recently used), or None."""
        weights = self._copies.get(adapter_id)
        if weights is not None:
            self._copies.move_to_end(adapter_id)
        return weights

    def _victim(self, keep: set[int]) -> int | None:
        fallback = None
        for aid in self._copies:
            if aid in self.pinned:
                continue
            if aid not in keep:
                return aid
            if fallback is None:
                fallback = aid
        return fallback

    def room(self, keep: set[int] = frozenset()) -> int:
        """How many copies could be added without evicting a pinned one or one in `keep`."""
        evictable = sum(1 for a in self._copies if a not in self.pinned and a not in keep)
        return self.capacity - len(self._copies) + evictable

    def put(self, adapter_id: int, weights, keep: set[int] = frozenset()) -> list[int]:
        """Insert (or refresh) a copy; returns the ids evicted to stay within capacity.
        Raises CapacityError, nothing changed, when only pinned copies could make room."""
        if adapter_id in self._copies:
            self._copies[adapter_id] = weights
            self._copies.move_to_end(adapter_id)
            return []
        if len(self._copies) >= self.capacity and self._victim(keep) is None:
            raise CapacityError(
                f"host memory holds max_cpu_loras={self.capacity} adapters, all pinned: "
                f"adapter {adapter_id} would need to evict a pinned one")
        evicted = []
        while len(self._copies) >= self.capacity:
            victim = self._victim(keep)
            evicted.append(victim)
            del self._copies[victim]
        self._copies[adapter_id] = weights
        return evicted

    def drop(self, adapter_id: int) -> None:
        self._copies.pop(adapter_id, None)
