"""The engine's adapter operations by name: load, pin, unload, retirement, per-adapter stats.

It ties the pieces below the control plane together: the registry (ids and lifecycle), the
pins (the one pin set, engine/adapters/pins.py), residency (host copies and slots) and
the KV cache (one prefix-cache namespace per adapter id). Requests never come through
here; the engine's step loop calls `free_retired` whenever a request may have ended.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NamedTuple

from loramux_engine.adapters.pins import Pins
from loramux_engine.adapters.registry import BASE_ID, AdapterRegistry
from loramux_engine.adapters.residency import AdapterResidency
from loramux_engine.adapters.slots import SlotTable
from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_core.errors import CapacityError


class ReadAdapter(NamedTuple):
    """An adapter read from disk and validated, not registered yet; or only checked
    (`weights` None: read at its first use, see AdapterService.read)."""
    name: str
    path: str
    weights: Any          # LoRAWeights, or None when only checked
    version: str          # digest of the bytes it was built from (safe_files), or when
                          # only checked, the version named or the files' fingerprint
    rank: int = 0


class AdapterService:
    def __init__(self, registry: AdapterRegistry, slots: SlotTable, pins: Pins,
                 residency: AdapterResidency, kv: KVCacheManager, check=None):
        """`check`: (path, expected version) -> AdapterPlan, the checks of a read without
        reading the weights (engine/assembly.py adapter_checker); None: reads only."""
        self.registry = registry
        self.slots = slots
        self.pins = pins
        self.residency = residency
        self.kv = kv
        self.check = check
        self.base_cache_hits = 0  # prefix-cache hits of base-model requests

    def add(self, name: str, path: str | Path, pinned: bool = False,
            version: str | None = None) -> int:
        """See Engine.add_adapter."""
        self.registry.check_name(name)
        if pinned:
            self._check_can_pin(name)  # before the read: fail fast
        return self.register(self.read(name, path, version), pinned)

    def read(self, name: str, path: str | Path, version: str | None = None,
             lazy: bool = False) -> "ReadAdapter":
        """See Engine.read_adapter: reads and validates, changes nothing (any thread).
        `lazy` (when the engine has `check`): only what needs no weights is checked now;
        the version is `version` or the files' fingerprint, and the weights are read, and
        checked in full, when a request first needs them."""
        self.registry.check_name(name)
        if lazy and self.check is not None:
            plan = self.check(str(path), version)
            return ReadAdapter(name, str(path), None, version or plan.fingerprint,
                               plan.max_rank)
        t0 = time.perf_counter()
        weights = self.residency.loader.read(path, version)
        self.residency.disk_read_seconds.observe(time.perf_counter() - t0)
        return ReadAdapter(name, str(path), weights, weights.version, weights.max_rank)

    def register(self, read: "ReadAdapter", pinned: bool = False) -> int:
        """See Engine.register_adapter."""
        if pinned:
            self._check_can_pin(read.name)
        old = self.registry.current(read.name)
        if pinned and read.weights is None:  # a pin holds a host copy: read it now
            read = self.read(read.name, read.path, read.version)
        aid = self.registry.add(read.name, read.path, read.rank, read.version)
        if read.weights is not None:
            self.residency.add_host_copy(aid, read.weights, pinned)
        if old is not None:  # a retiring version holds no pin (its requests are busy anyway)
            self.set_pin(old.adapter_id, False)
        self.set_pin(aid, pinned)
        self.free_retired()  # the replaced version may be idle already
        return aid

    def set_pinned(self, name: str, pinned: bool) -> int:
        """See Engine.set_adapter_pinned."""
        aid = self.registry.resolve(name)
        if pinned and aid not in self.pins:
            self._check_can_pin(name)
            self.residency.ensure_host_copy(aid)
        self.set_pin(aid, pinned)
        return aid

    def remove(self, name: str) -> int:
        """See Engine.remove_adapter."""
        aid = self.registry.remove(name)
        self.set_pin(aid, False)
        self.free_retired()
        return aid

    def retire(self, aid: int) -> None:
        """Retire a version that can no longer be read back (its files changed or vanished)."""
        self.set_pin(aid, False)
        self.registry.retire(aid)

    def set_pin(self, aid: int, pinned: bool) -> None:
        self.pins.set(aid, pinned)

    def _check_can_pin(self, name: str) -> None:
        current = self.registry.current(name)
        self.pins.check_room(name, current.adapter_id if current else None)

    def free_retired(self) -> None:
        """Free the slot, host copy and KV namespace of every retired version whose last
        request has ended."""
        for rec in self.registry.take_ready():
            self.pins.set(rec.adapter_id, False)
            self.residency.forget(rec.adapter_id)
            self.kv.evict_namespace(rec.adapter_id)

    def pinned_to_load(self, wanted: list[int]) -> list[int]:
        """Pinned adapters not in a slot and not already in `wanted` (in id order)."""
        return [a for a in self.pins if self.slots.slot_of(a) is None and a not in wanted]

    def count_cache_hits(self, adapter_id: int, hits: int) -> None:
        """Credit prefix-cache hits to the adapter version (or the base model) they served."""
        if adapter_id == BASE_ID:
            self.base_cache_hits += hits
        else:
            self.registry.get(adapter_id).cached_token_hits += hits

    def stats(self) -> dict[int, dict]:
        """Per adapter version (keyed by id): see Engine.stats."""
        adapters = {}
        for rec in self.registry.records():
            aid = rec.adapter_id
            adapters[aid] = {
                "name": rec.name, "id": aid, "path": rec.path, "rank": rec.rank,
                "version": rec.version,
                "state": self.residency.state(aid), "slot": self.slots.slot_of(aid),
                "pinned": aid in self.pins, "unloading": rec.retiring, "in_flight": rec.in_flight,
                "loads": rec.loads, "evictions": rec.evictions, "disk_reads": rec.disk_reads,
                "host_evictions": rec.host_evictions,
                "cached_token_hits": rec.cached_token_hits}
        return adapters
