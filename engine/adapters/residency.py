"""Adapter residency across the three tiers: device slots, host copies, files on disk.

    disk ──read (background thread)──▶ host ──copy (side stream)──▶ slot (loading ▶ ready)
      ▲                                  │                             │
      └──────── LRU eviction ────────────┴──────── LRU eviction ───────┘

The engine calls, once per step and after the batch is fixed:

- `poll()`: finished disk reads join the host tier; finished copies let go of the host
  copy they read.
- `prefetch(wanted, busy)`: for the adapters waiting requests need (the scheduler's
  priority order), start disk reads and host→device copies. Slot eviction never touches
  `busy` adapters (those with running requests: a superset of the batch just built) nor
  pinned ones nor adapters ahead in the order, so a copy never overwrites a slot the batch
  reads.

Progress. Call `head` the first adapter of the priority order without a slot: the one
the scheduler runs next once a slot is free (see "Fairness" in engine/scheduler.py).
Every step keeps, for the head:

- R1 (read). Without a host copy, its disk read is pending or starts now. Its read is
  never refused for room: its copy may displace any unpinned copy (host_cache.py claims:
  NEEDED at priority 0 is the strongest unpinned claim), and pins leave at least one
  place (pinned <= max_loras - 1 < max_loras <= max_cpu_loras). Other adapters' reads
  start only where a copy with a weaker claim than theirs (or a free place) is left.
- R2 (host copy). Once read, its copy is displaced by no read or traffic of any other
  adapter; only an admin pin (which claims PIN) can, and then R1 reads it again.
- R3 (slot). With its host copy, it takes a slot in the same step as some slot holds
  none of: a running adapter, a pinned one, an adapter ahead of it.
  Adapters behind it get no slot before it does.

So a read the head needs lands within one read's time (the engine steps on meanwhile and
waits for it only when nothing else can run), and the head is placed as soon as the
scheduler frees a slot: the scheduler's drain bounds that in steps.

A copy is ordered by events, never by a host sync (engine/adapters/copier.py): on CUDA it
runs on a side stream as soon as it is queued (during the step in flight), after only the
last launched step that read its slot (`note_step_reads`, called by the engine after each
launch: it matters where a request was preempted while a step in flight still reads its
slot), and the slot is usable at once: the scheduler may admit requests of the adapter
in the very next schedule, and `order_before_step` makes the compute stream wait for the
copy's event before the step that reads the slot. On the CPU copies are synchronous.

With tensor parallelism, `mirror` (engine/distributed/adapters.py) hears of every slot
load, host-copy drop and retirement, by adapter id, so the other ranks follow; these are
the only places residency writes into the slot pool or lets go of a host copy.
"""
from __future__ import annotations

import time

import torch

from loramux_engine.adapters.copier import copier_for
from loramux_engine.adapters.host_cache import PIN, HostCache
from loramux_engine.adapters.loader import DiskLoader, LoadResult
from loramux_engine.adapters.registry import AdapterRegistry
from loramux_engine.adapters.slots import SlotTable
from loramux_engine.telemetry import LOAD_SECONDS, Histogram


class AdapterResidency:
    def __init__(self, registry: AdapterRegistry, slots: SlotTable, host: HostCache,
                 loader: DiskLoader, lora_pool, device: torch.device, mirror=None,
                 copier=None):
        self.registry = registry
        self.slots = slots
        self.host = host
        self.loader = loader
        self.lora_pool = lora_pool
        self.mirror = mirror
        self.copier = copier if copier is not None else copier_for(device)
        # adapter id -> (copy handle, host weights kept alive, time queued)
        self._copies: dict[int, tuple] = {}
        self._reads_started: dict[int, float] = {}
        # disk -> host reads and host -> slot loads (a swap when it evicts), start to landed
        self.disk_read_seconds = Histogram("adapter_disk_read_seconds", LOAD_SECONDS)
        self.slot_load_seconds = Histogram("adapter_slot_load_seconds", LOAD_SECONDS)

    # ---- tiers ------------------------------------------------------------------
    def add_host_copy(self, adapter_id: int, weights, pinned: bool = False) -> None:
        """A freshly validated version enters the host tier, displacing only an idle copy
        (or any unpinned one when `pinned`); without room it stays on disk until needed."""
        claim = (PIN,) if pinned else None
        self._put(adapter_id, weights, claim)

    def ensure_host_copy(self, adapter_id: int) -> None:
        """Read the version back from disk now if its host copy was evicted (pinning)."""
        if adapter_id in self.host:
            return
        rec = self.registry.get(adapter_id)
        self.loader.cancel(adapter_id)
        t0 = time.perf_counter()
        weights = self.loader.read(rec.path, rec.version)
        self.disk_read_seconds.observe(time.perf_counter() - t0)
        rec.disk_reads += 1
        self._put(adapter_id, weights, (PIN,))

    def _put(self, adapter_id: int, weights, claim) -> None:
        evicted = self.host.put(adapter_id, weights, claim)
        if evicted is None:  # no weaker copy to displace: it stays on disk
            if self.mirror is not None:
                self.mirror.host_dropped(adapter_id)
            return
        for aid in evicted:
            if self.mirror is not None:
                self.mirror.host_dropped(aid)
            rec = self.registry.find(aid)
            if rec is not None:
                rec.host_evictions += 1

    def state(self, adapter_id: int) -> str:
        """'slot' (ready in a device slot), 'host' or 'disk'."""
        if self.slots.ready_slot(adapter_id) is not None:
            return "slot"
        return "host" if adapter_id in self.host else "disk"

    def forget(self, adapter_id: int) -> None:
        """Drop every copy of a retired version (its requests have all ended). The slot's
        contents are not touched: nothing maps to it, the next load overwrites it."""
        self.slots.release(adapter_id)
        self.host.drop(adapter_id)
        self.loader.cancel(adapter_id)
        self._reads_started.pop(adapter_id, None)
        if self.mirror is not None:
            self.mirror.retired(adapter_id)

    # ---- per step ---------------------------------------------------------------
    def poll(self) -> list[LoadResult]:
        """Move finished work along the tiers; returns failed disk reads."""
        failed = []
        for res in self.loader.collect():
            t0 = self._reads_started.pop(res.adapter_id, None)
            rec = self.registry.find(res.adapter_id)
            if rec is None:
                continue  # retired while being read
            if res.error is not None:
                failed.append(res)
                continue
            if t0 is not None:
                self.disk_read_seconds.observe(time.perf_counter() - t0)
            rec.disk_reads += 1
            self._put(res.adapter_id, res.weights, None)  # claim: NEEDED if still wanted
        for aid, (handle, _weights, t0) in list(self._copies.items()):
            if self.copier.done(handle):
                del self._copies[aid]
                self.slot_load_seconds.observe(time.perf_counter() - t0)
        return failed

    def prefetch(self, wanted: list[int], busy: set[int]) -> bool:
        """Bring `wanted` (highest priority first) toward ready slots without evicting
        `busy` or pinned adapters, or a wanted adapter for a lower-priority one, keeping
        R1-R3 (module docstring). True if a slot became ready at once (synchronous copies
        on the CPU)."""
        needed = [aid for aid in wanted if self.slots.slot_of(aid) is None]
        self.host.set_claims(needed, busy)
        rooms = self.host.read_rooms()  # the loop below changes no copy and no claim
        for aid in busy:
            self.host.touch(aid)
        made_ready = False
        protected = set(busy)
        for aid in wanted:
            if self.slots.slot_of(aid) is not None:
                self.slots.touch(aid)
                self.host.touch(aid)
                protected.add(aid)
                continue
            weights = self.host.get(aid)
            if weights is None:
                self._start_read(aid, aid == needed[0], rooms)
                continue
            if not self._load_slot(aid, weights, protected):
                break  # no slot for this one: none for lower priorities either (R3)
            protected.add(aid)
            made_ready |= self.slots.ready_slot(aid) is not None
        return made_ready

    def _start_read(self, aid: int, head: bool, rooms: dict[int, int]) -> None:
        """R1: the head's read always starts; another's only where its copy will fit
        without displacing a stronger claim (counting the reads already pending). `rooms`:
        HostCache.read_rooms of this step, which lacks only an adapter that lost its slot
        to a higher-priority one in this very prefetch (it needed none when claims were set)."""
        if self.loader.is_pending(aid):
            return
        if not head:
            room = rooms.get(aid)
            if room is None:
                room = self.host.room_for(self.host.claim(aid))
            if room <= self.loader.num_pending:
                return
        rec = self.registry.get(aid)
        self.loader.submit(aid, rec.path, rec.version)
        self._reads_started[aid] = time.perf_counter()

    def _load_slot(self, aid: int, weights, protected: set[int]) -> bool:
        a = self.slots.assign(aid, protected)
        if a is None:
            return False
        if a.evicted is not None:
            rec = self.registry.find(a.evicted)
            if rec is not None:
                rec.evictions += 1
        self.registry.get(aid).loads += 1
        t0 = time.perf_counter()
        handle = self.copier.queue(a.slot, aid, lambda: self._write_slot(a.slot, aid, weights))
        if handle is not None:
            self._copies[aid] = (handle, weights, t0)
        else:
            self.slot_load_seconds.observe(time.perf_counter() - t0)
        self.slots.mark_ready(aid)  # readable by a step ordered after the copy
        return True

    def order_before_step(self, adapter_ids) -> None:
        """The step about to be launched reads the slots of `adapter_ids`: it runs after
        every copy into them that may still be in flight (an event wait, not a sync)."""
        for aid in adapter_ids:
            entry = self._copies.get(aid)
            if entry is not None:
                self.copier.order_compute_after(entry[0])

    def note_step_reads(self, slots) -> None:
        """The step just launched reads `slots` (-1: base rows): a later copy into one of
        them is ordered after it on the device (engine/adapters/copier.py)."""
        self.copier.note_reads(slots)

    def _write_slot(self, slot: int, aid: int, weights) -> None:
        self.lora_pool.load(slot, weights)
        if self.mirror is not None:
            self.mirror.slot_loaded(slot, aid)

    def has_pending(self) -> bool:
        return bool(self._copies) or self.loader.num_pending > 0

    def wait_pending(self) -> bool:
        """Block until some pending read finishes; only called when nothing else can run,
        so no request waits for another one's adapter. False if none pending (copies in
        flight never block: a step is ordered after them)."""
        if self.loader.num_pending:
            self.loader.wait_any()
            return True
        return False
