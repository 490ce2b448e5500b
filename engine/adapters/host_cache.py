"""The host tier: copies of adapter weights in host memory (pinned memory on CUDA).

At most `capacity` copies. Each copy has a claim to stay; over capacity the copy with the
weakest claim goes first, and a newcomer may only displace a copy whose claim is weaker
than its own (else it is not kept: its adapter stays on disk). Claims, strongest first:

    PIN          pinned adapters: never evicted implicitly
    NEEDED(p)    adapters waiting requests need and that hold no slot, by the scheduler's
                 priority p (0 = the adapter it runs next): copied into a slot soon
    IN_USE       adapters with running requests (their copy only matters for a later
                 reload, but they are the working set), least recently used first
    IDLE         everything else, least recently used first

"Used" means a request of it was scheduled, or it was wanted, read or loaded. The
residency manager (residency.py) sets the NEEDED and IN_USE claims once per step
(`set_claims`) and touches copies as they are used. A copy evicted here is read again
from disk when a request needs it (loader.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection
from typing import Any

from loramux_core.errors import CapacityError


IDLE, IN_USE, NEEDED, PIN = range(4)


class HostCache:
    def __init__(self, capacity: int, pins: Collection[int]):
        """`pins`: the pinned adapter ids (engine/adapters/pins.py), never evicted."""
        assert capacity >= 1, capacity
        self.capacity = capacity
        self.pins = pins
        self._copies: OrderedDict[int, Any] = OrderedDict()  # adapter id -> weights, LRU first
        self._needed: dict[int, int] = {}  # adapter id -> priority (0 = runs next)
        self._in_use: set[int] = set()

    def __contains__(self, adapter_id: int) -> bool:
        return adapter_id in self._copies

    def __len__(self) -> int:
        return len(self._copies)

    def ids(self) -> list[int]:
        """Adapter ids with a copy, least recently used first."""
        return list(self._copies)

    def set_claims(self, needed: list[int], in_use: set[int]) -> None:
        """This step's claims: `needed` (priority order) lack a slot, `in_use` run."""
        self._needed = {aid: p for p, aid in enumerate(needed)}
        self._in_use = set(in_use)

    def claim(self, adapter_id: int, age: int | None = None) -> tuple:
        """How strongly the adapter's copy should stay (comparable, larger stays). `age`:
        its place in the LRU order (0 = least recently used; default: newest)."""
        if adapter_id in self.pins:
            return (PIN,)
        if adapter_id in self._needed:
            return (NEEDED, -self._needed[adapter_id])
        age = len(self._copies) if age is None else age
        return (IN_USE if adapter_id in self._in_use else IDLE, age)

    def touch(self, adapter_id: int) -> None:
        """The adapter was used now (most recently used)."""
        if adapter_id in self._copies:
            self._copies.move_to_end(adapter_id)

    def get(self, adapter_id: int):
        """The host copy (marked most recently used), or None."""
        weights = self._copies.get(adapter_id)
        if weights is not None:
            self._copies.move_to_end(adapter_id)
        return weights

    def _claims(self):
        return ((aid, self.claim(aid, age)) for age, aid in enumerate(self._copies))

    def victim(self, stronger_than: tuple) -> int | None:
        """The copy to evict for a newcomer with claim `stronger_than`: the weakest claim
        below it (least recently used first among equals); None if there is none. The
        first IDLE copy in LRU order is the weakest of all, so the scan stops there: it
        passes only the copies with a claim (pinned, needed, in use), not thousands."""
        weaker = []
        for aid, c in self._claims():
            if c[0] == IDLE:
                return aid if c < stronger_than else None
            if c < stronger_than:
                weaker.append((c, aid))
        return min(weaker)[1] if weaker else None

    def room_for(self, claim: tuple) -> int:
        """How many newcomers with `claim` could be kept: free places plus copies with a
        weaker claim."""
        weaker = sum(1 for _, c in self._claims() if c < claim)
        return self.capacity - len(self._copies) + weaker

    def read_rooms(self) -> dict[int, int]:
        """`room_for(claim(aid))` of every needed adapter without a copy, under this
        step's claims, all at once: O(needed + pins), where `room_for` scans every copy
        for each. A needed newcomer is kept in place of any copy but a pinned one or a
        needed one ahead of it, so its room is the capacity less those. Valid until the
        claims or the copies held change (set_claims, put, drop)."""
        pinned = sum(1 for aid in self.pins if aid in self._copies)
        rooms, ahead = {}, 0
        for aid in self._needed:  # priority order
            if aid in self.pins:
                if aid not in self._copies:
                    rooms[aid] = self.capacity - pinned
            elif aid in self._copies:
                ahead += 1
            else:
                rooms[aid] = self.capacity - pinned - ahead
        return rooms

    def put(self, adapter_id: int, weights, claim: tuple | None = None) -> list[int] | None:
        """Insert (or refresh) a copy as most recently used. Over capacity it displaces
        the copy with the weakest claim below `claim` (default: the adapter's own claim as
        the newest copy, so an idle newcomer displaces only an older idle copy). Returns
        the evicted ids, or None when nothing could make room (the copy is not kept). A
        pinned newcomer that only pinned copies block raises CapacityError."""
        if adapter_id in self._copies:
            self._copies[adapter_id] = weights
            self._copies.move_to_end(adapter_id)
            return []
        claim = self.claim(adapter_id) if claim is None else claim
        evicted = []
        if len(self._copies) >= self.capacity:  # never above: one place is enough
            victim = self.victim(claim)
            if victim is None:
                if claim >= (PIN,):
                    raise CapacityError(
                        f"host memory holds max_cpu_loras={self.capacity} adapters, all "
                        f"pinned: adapter {adapter_id} would need to evict a pinned one")
                return None
            del self._copies[victim]
            evicted.append(victim)
        self._copies[adapter_id] = weights
        return evicted

    def drop(self, adapter_id: int) -> None:
        self._copies.pop(adapter_id, None)
        self._needed.pop(adapter_id, None)
        self._in_use.discard(adapter_id)
