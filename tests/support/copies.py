"""A slot copier that behaves like the worst legal device: every host -> slot copy is
deferred until something forces it (a step ordered after it, a wait) or until it has been
polled `lag` times, and the slot holds NaN meanwhile. A step that reads a slot before
its copy has landed then reads NaN, which `assert_clean` (and every token) catches.

It also checks, when a copy is queued, that the slot's previous adapter has no running
request (an in-flight or next step may still read that slot for it), and that every
launched step that read the slot was noted (`note_reads`) before the copy: on a device the
copy is ordered after the noted reads only, so an unnoted reader still in flight (a
request preempted or finished while its step runs) would see the slot change under it.
The test tells the copier of each launch (`launched`), from outside the engine."""
from __future__ import annotations

from typing import Callable


class PoisonedCopier:
    def __init__(self, pool, busy: Callable[[], set[int]], lag: int = 2):
        self.pool = pool
        self.busy = busy
        self.lag = lag
        self.owner: dict[int, int] = {}       # slot -> adapter id last queued into it
        self._pending: dict[int, list] = {}   # handle -> [copy, polls left]
        self._next = 0
        self.num_forced = 0                   # copies a step's ordering made land
        self.num_background = 0               # copies that landed on their own
        self.num_launches = 0
        self._read_by: dict[int, int] = {}   # slot -> last launch that read it
        self._noted: dict[int, int] = {}     # slot -> last launch noted as reading it
        self.num_noted_overwrites = 0         # copies into a slot a noted launch had read

    def launched(self, slots) -> None:
        """A step reading `slots` was launched (what actually runs, seen by the test)."""
        self.num_launches += 1
        for slot in slots:
            if slot >= 0:
                self._read_by[slot] = self.num_launches

    def note_reads(self, slots) -> None:
        for slot in slots:
            if slot >= 0:
                self._noted[slot] = self.num_launches

    def queue(self, slot: int, adapter_id: int, copy):
        prev = self.owner.get(slot)
        assert prev is None or prev not in self.busy(), (
            f"slot {slot} overwritten while adapter {prev} has running requests")
        read = self._read_by.get(slot, 0)
        assert self._noted.get(slot, 0) >= read, (
            f"copy into slot {slot} not ordered after launch {read}, which read it")
        self.num_noted_overwrites += read > 0
        self.owner[slot] = adapter_id
        self.poison(slot)
        self._next += 1
        self._pending[self._next] = [copy, self.lag]
        return self._next

    def poison(self, slot: int) -> None:
        for layer in range(self.pool.num_layers):
            for group in ("qkv", "o", "gate_up", "down"):
                a, b, _, _ = self.pool.weights(layer, group)
                a[slot].fill_(float("nan"))
                b[slot].fill_(float("nan"))
        self.pool.mark_dirty(slot)

    def _land(self, handle) -> None:
        entry = self._pending.pop(handle, None)
        if entry is not None:
            entry[0]()

    def done(self, handle) -> bool:
        entry = self._pending.get(handle)
        if entry is None:
            return True
        entry[1] -= 1
        if entry[1] <= 0:
            self.num_background += 1
            self._land(handle)
            return True
        return False

    def order_compute_after(self, handle) -> None:
        if handle in self._pending:
            self.num_forced += 1
        self._land(handle)

    def wait(self, handle) -> None:
        self._land(handle)

    def is_poisoned(self, slot: int) -> bool:
        a, _, _, _ = self.pool.weights(0, "qkv")
        return bool(a[slot].isnan().any())
