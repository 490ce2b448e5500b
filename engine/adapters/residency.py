"""Adapter residency across the three tiers: device slots, host copies, files on disk.

    disk ──read (background thread)──▶ host ──copy (side stream)──▶ slot (loading ▶ ready)
      ▲                                  │                             │
      └──────── LRU eviction ────────────┴──────── LRU eviction ───────┘

The engine calls, once per step and after the batch is fixed:

- `poll()`: finished disk reads join the host tier; finished copies make slots ready.
- `prefetch(wanted, busy)`: for the adapters waiting requests need (priority order),
  start disk reads and host→device copies. Slot eviction never touches `busy` adapters
  (those with running requests: a superset of the batch just built) nor pinned ones nor
  adapters with a higher claim, so a copy never overwrites a slot the batch reads.

On CUDA a copy runs on a side stream, ordered after all work queued so far on the compute
stream (the previous reader of the slot), and its event tells when the slot is ready; the
scheduler only admits requests whose adapter's slot is ready, so no step waits for a copy
of another request. On the CPU copies are synchronous.

With tensor parallelism, `mirror` (engine/distributed/adapters.py) hears of every slot
load, host-copy drop and retirement, by adapter id, so the other ranks follow; these are
the only places residency writes into the slot pool or lets go of a host copy.
"""
from __future__ import annotations

import torch

from engine.adapters.host_cache import HostCache
from engine.adapters.loader import DiskLoader, LoadResult
from engine.adapters.registry import AdapterRegistry
from engine.adapters.slots import SlotTable


class AdapterResidency:
    def __init__(self, registry: AdapterRegistry, slots: SlotTable, host: HostCache,
                 loader: DiskLoader, lora_pool, device: torch.device, mirror=None):
        self.registry = registry
        self.slots = slots
        self.host = host
        self.loader = loader
        self.lora_pool = lora_pool
        self.mirror = mirror
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._copies: dict[int, tuple] = {}  # adapter id -> (event, host weights kept alive)
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
        weights = self.loader.read(rec.path, rec.version)
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
        for aid, (event, _weights) in list(self._copies.items()):
            if event.query():
                del self._copies[aid]
                self.slots.mark_ready(aid)
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
                    self.loader.submit(aid, rec.path, rec.version)
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
        if self._stream is None:
            self._write_slot(a.slot, aid, weights)
            self.slots.mark_ready(aid)
            return True
        # ordered after everything already queued on the compute stream, i.e. after the
        # last batch that may have read this slot's previous occupant
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        self._write_slot(a.slot, aid, weights, stream=self._stream)
        event = torch.cuda.Event()
        event.record(self._stream)
        self._copies[aid] = (event, weights)
        return True

    def _write_slot(self, slot: int, aid: int, weights, stream=None) -> None:
        self.lora_pool.load(slot, weights, stream=stream)
        if self.mirror is not None:
            self.mirror.slot_loaded(slot, aid)

    def has_pending(self) -> bool:
        return bool(self._copies) or self.loader.num_pending > 0

    def wait_pending(self) -> bool:
        """Block until some pending read or copy finishes; only called when nothing else
        can run, so no request waits for another one's adapter. False if none pending."""
        if self._copies:
            next(iter(self._copies.values()))[0].synchronize()
            return True
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
