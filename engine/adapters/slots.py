"""Device slot residency: which adapter id sits in which of the `max_loras` slots.

Pure bookkeeping; copying weights is the residency manager's job. A slot is

    free ──assign──▶ loading ──mark_ready (copy queued)──▶ ready ──release / evict──▶ free

Only a ready slot may be read by a batch: its copy is queued, and a step that reads it
is ordered after the copy on the device (engine/adapters/copier.py; the copy may still
be in flight). Eviction takes the least recently used ready slot whose adapter is
neither pinned nor in the caller's `protected` set (the running adapters, which include
every adapter of the batch being built, and adapters with a higher claim on a slot);
copies into one slot run in the order they were queued, on one stream.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container
from typing import NamedTuple


class SlotAssignment(NamedTuple):
    slot: int
    needs_load: bool          # weights must be copied into the slot before use
    evicted: int | None       # adapter id that held the slot before, if any


class SlotTable:
    def __init__(self, num_slots: int, pins: Container[int] = frozenset()):
        """`pins`: the pinned adapter ids (engine/adapters/pins.py), never evicted."""
        self.num_slots = num_slots
        self._owner: list[int | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots))  # heap: the lowest free slot first
        self._lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._loading: set[int] = set()
        self.pins = pins

    def slot_of(self, adapter_id: int) -> int | None:
        """Slot held by the adapter, ready or still loading."""
        return self._lru.get(adapter_id)

    def ready_slot(self, adapter_id: int) -> int | None:
        """Slot a batch may read for the adapter, or None (absent or copy in flight)."""
        return None if adapter_id in self._loading else self._lru.get(adapter_id)

    def is_loading(self, adapter_id: int) -> bool:
        return adapter_id in self._loading

    def resident(self) -> dict[int, int]:
        return dict(self._lru)

    @property
    def num_used(self) -> int:
        return len(self._lru)

    def _victim(self, protected: set[int]) -> int | None:
        """Slot to (re)use: the lowest free one, else the least recently used evictable one."""
        if self._free:
            return self._free[0]
        for aid, slot in self._lru.items():
            if aid not in protected and aid not in self.pins and aid not in self._loading:
                return slot
        return None

    def can_assign(self, adapter_id: int, protected: set[int]) -> bool:
        return adapter_id in self._lru or self._victim(protected) is not None

    def assign(self, adapter_id: int, protected: set[int]) -> SlotAssignment | None:
        """Give `adapter_id` a slot (marking it most recently used), or None when every slot
        is pinned, protected or loading. A new assignment is `loading` until mark_ready."""
        if adapter_id in self._lru:
            self._lru.move_to_end(adapter_id)
            return SlotAssignment(self._lru[adapter_id], False, None)
        slot = self._victim(protected)
        if slot is None:
            return None
        evicted = self._owner[slot]
        if evicted is None:
            heapq.heappop(self._free)  # `slot`, the lowest free one
        else:
            del self._lru[evicted]
        self._owner[slot] = adapter_id
        self._lru[adapter_id] = slot
        self._loading.add(adapter_id)
        return SlotAssignment(slot, True, evicted)

    def mark_ready(self, adapter_id: int) -> None:
        """The adapter's weights are fully in its slot (copy completed)."""
        self._loading.discard(adapter_id)

    def touch(self, adapter_id: int) -> None:
        if adapter_id in self._lru:
            self._lru.move_to_end(adapter_id)

    def release(self, adapter_id: int) -> int | None:
        """Take the adapter out of its slot (unload); returns the freed slot. The slot's
        weights are left as they are: no token maps to a free slot, and the next load
        overwrites every element."""
        slot = self._lru.pop(adapter_id, None)
        if slot is not None:
            self._owner[slot] = None
            heapq.heappush(self._free, slot)
        self._loading.discard(adapter_id)
        return slot
