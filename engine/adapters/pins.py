"""The pinned adapter versions: the one owner of pin state in an engine.

A pinned version is never evicted implicitly, neither from its device slot (SlotTable)
nor from host memory (HostCache), and is brought into a slot at the next step; the
scheduler never pauses its requests for a drain. Pins take at most `max_loras - 1`
slots, so one slot always rotates. The slot table, the host cache, the scheduler and the
adapter stats ask this set; only AdapterService changes it (pin, unpin, and a version's
retirement).
"""
from __future__ import annotations

from collections.abc import Iterator

from loramux_core.errors import CapacityError


class Pins:
    def __init__(self, max_loras: int):
        self._ids: set[int] = set()
        self.max_loras = max_loras

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._ids

    def __iter__(self) -> Iterator[int]:
        """The pinned ids, in id order."""
        return iter(sorted(self._ids))

    def __len__(self) -> int:
        return len(self._ids)

    def set(self, adapter_id: int, pinned: bool) -> None:
        (self._ids.add if pinned else self._ids.discard)(adapter_id)

    def check_room(self, name: str, replacing: int | None = None) -> None:
        """CapacityError unless `name` may be pinned (in place of its version
        `replacing`, if pinned) with one slot left dynamic."""
        others = self._ids - {replacing}
        if len(others) + 1 >= self.max_loras:
            raise CapacityError(
                f"cannot pin adapter {name!r}: {len(others)} of max_loras="
                f"{self.max_loras} slots are pinned and one must stay dynamic")
