"""Device slot residency: which adapter id sits in which of the `max_loras` slots.

Pure bookkeeping; copying weights into a slot is the LoRA pool's job, done by the runner
before the forward pass that first needs them. Eviction is least recently used among the
adapters that are not `busy` (held by running requests or by the batch being built) and
not pinned, so a slot assigned to the current batch can never be taken for another
adapter of the same batch.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple


class SlotAssignment(NamedTuple):
    slot: int
    needs_load: bool          # weights must be copied into the slot before use
    evicted: int | None       # adapter id that held the slot before, if any


class SlotTable:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._owner: list[int | None] = [None] * num_slots
        self._lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self.pinned: set[int] = set()

    def slot_of(self, adapter_id: int) -> int | None:
        return self._lru.get(adapter_id)

    def resident(self) -> dict[int, int]:
        return dict(self._lru)

    def _victim(self, busy: set[int]) -> int | None:
        """Slot to (re)use: a free one, else the least recently used evictable one."""
        for slot, owner in enumerate(self._owner):
            if owner is None:
                return slot
        for aid, slot in self._lru.items():
            if aid not in busy and aid not in self.pinned:
                return slot
        return None

    def can_assign(self, adapter_id: int, busy: set[int]) -> bool:
        return adapter_id in self._lru or self._victim(busy) is not None

    def assign(self, adapter_id: int, busy: set[int]) -> SlotAssignment | None:
        """Put `adapter_id` in a slot (marking it most recently used), or None when every
        slot is held by a busy or pinned adapter."""
        if adapter_id in self._lru:
            self._lru.move_to_end(adapter_id)
            return SlotAssignment(self._lru[adapter_id], False, None)
        slot = self._victim(busy)
        if slot is None:
            return None
        evicted = self._owner[slot]
        if evicted is not None:
            del self._lru[evicted]
        self._owner[slot] = adapter_id
        self._lru[adapter_id] = slot
        return SlotAssignment(slot, True, evicted)

    def touch(self, adapter_id: int) -> None:
        if adapter_id in self._lru:
            self._lru.move_to_end(adapter_id)

    def release(self, adapter_id: int) -> int | None:
        """Take the adapter out of its slot (unload); returns the freed slot."""
        slot = self._lru.pop(adapter_id, None)
        if slot is not None:
            self._owner[slot] = None
        self.pinned.discard(adapter_id)
        return slot
