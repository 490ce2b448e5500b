"""Adapter residency across the three tiers: device slots, host copies, files on disk.

    disk ──read (background thread)──▶ host ──copy (side stream)──▶ slot (loading ▶ ready)
      ▲                                  │                             │
      └──────── LRU eviction ────────────┴──────── LRU eviction ───────┘

The engine calls, once per step and after the batch is fixed:

- `poll()`: finished disk reads join the host tier; finished copies let go of the host
  copy they read.
- `prefetch(wanted, busy)`: for the adapters waiting requests need (priority order),
  start disk reads and host→device copies. Slot eviction never touches `busy` adapters
  (those with running requests: a superset of the batch just built) nor pinned ones nor
  adapters with a higher claim, so a copy never overwrites a slot the batch reads.

A copy is ordered by events, never by a host sync (engine/adapters/copier.py): on CUDA it
runs on a side stream after all work queued so far on the compute stream (the previous
readers of the slot), and the slot is usable at once: the scheduler may admit requests
of the adapter in the very next schedule, and `order_before_step` makes the compute
stream wait for the copy's event before the step that reads the slot. On the CPU copies
are synchronous.

With tensor parallelism, `mirror` (engine/distributed/adapters.py) hears of every slot
load, host-copy drop and retirement, by adapter id, so the other ranks follow; these are
the only places residency writes into the slot pool or lets go of a host copy.
"""
from __future__ import annotations

import torch

from engine.adapters.copier import copier_for
from engine.adapters.host_cache import HostCache
from engine.adapters.loader import DiskLoader, LoadResult
from engine.adapters.registry import AdapterRegistry
from engine.adapters.slots import SlotTable


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
        self._copies: dict[int, tuple] = {}  # adapter id -> (copy handle, host weights kept alive)
        self._wanted: set[int] = set()

    # ---- tiers ------------------------------------------------------------------
    def add_host_copy(self, adapter_id: int, weights) -> None:
        """A freshly read version enters the host tier (may evict an LRU copy)."""
        self._count_host_evictions(self.host.put(adapter_id, weights, keep=self._wanted))

    def ensure_host_copy(self, adapter_id: int) -> None:
        """Read the version back from disk now if its host copy was evicted (pinning)."""
        if adapter_id in self.host:
            return
        rec = self.registry.get(adapter_id)
        self.loader.cancel(adapter_id)
        weights = self.loader.read_checked(rec.path, rec.fingerprint)
        rec.disk_reads += 1
        self.add_host_copy(adapter_id, weights)

    def state(self, adapter_id: int) -> str:
        """'slot' (ready in a device slot), 'host' or 'disk'."""
        if self.slots.ready_slot(adapter_id) is not None:
            return "slot"
        return "host" if adapter_id in self.host else "disk"

    def forget(self, adapter_id: int) -> None:
        """Drop every copy of a retired version (its requests have all ended). The slot's
        contents are not touched: nothing maps to it, the next load overwrites it."""
        self.slots.release(adapter_id)
        self.slots.pinned.discard(adapter_id)
        self.host.drop(adapter_id)
        self.loader.cancel(adapter_id)
        self._wanted.discard(adapter_id)
        if self.mirror is not None:
            self.mirror.retired(adapter_id)

    # ---- per step ---------------------------------------------------------------
    def poll(self) -> list[LoadResult]:
        """Move finished work along the tiers; returns failed disk reads."""
        failed = []
        for res in self.loader.collect():
            rec = self.registry.find(res.adapter_id)
            if rec is None:
                continue  # retired while being read
            if res.error is not None:
                failed.append(res)
                continue
            rec.disk_reads += 1
            self.add_host_copy(res.adapter_id, res.weights)
        for aid, (handle, _weights) in list(self._copies.items()):
            if self.copier.done(handle):
                del self._copies[aid]
        return failed

    def prefetch(self, wanted: list[int], busy: set[int]) -> bool:
        """Bring `wanted` (highest priority first) toward ready slots without evicting
        `busy` or pinned adapters, or a wanted adapter for a lower-priority one. True if
        a slot became ready at once (synchronous copies on the CPU)."""
        made_ready = False
        self._wanted = set(wanted)
        protected = set(busy)
        reads = max(0, self.host.room(keep=self._wanted | protected) - self.loader.num_pending)
        for aid in wanted:
            if self.slots.slot_of(aid) is not None:
                self.slots.touch(aid)
                protected.add(aid)
                continue
            weights = self.host.get(aid)
            if weights is None:
                if reads > 0 and not self.loader.is_pending(aid):
                    rec = self.registry.get(aid)
                    self.loader.submit(aid, rec.path, rec.fingerprint)
                    reads -= 1
                continue
            if not self._load_slot(aid, weights, protected):
                break  # no slot for this one: none for lower priorities either
            protected.add(aid)
            made_ready |= self.slots.ready_slot(aid) is not None
        return made_ready

    def _load_slot(self, aid: int, weights, protected: set[int]) -> bool:
        a = self.slots.assign(aid, protected)
        if a is None:
            return False
        if a.evicted is not None:
            rec = self.registry.find(a.evicted)
            if rec is not None:
                rec.evictions += 1
        self.registry.get(aid).loads += 1
        handle = self.copier.queue(a.slot, aid, lambda: self._write_slot(a.slot, aid, weights))
        if handle is not None:
            self._copies[aid] = (handle, weights)
        self.slots.mark_ready(aid)  # readable by a step ordered after the copy
        return True

    def order_before_step(self, adapter_ids) -> None:
        """The step about to be launched reads the slots of `adapter_ids`: it runs after
        every copy into them that may still be in flight (an event wait, not a sync)."""
        for aid in adapter_ids:
            entry = self._copies.get(aid)
            if entry is not None:
                self.copier.order_compute_after(entry[0])

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

    def _count_host_evictions(self, evicted: list[int]) -> None:
        for aid in evicted:
            if self.mirror is not None:
                self.mirror.host_dropped(aid)
            rec = self.registry.find(aid)
            if rec is not None:
                rec.host_evictions += 1
