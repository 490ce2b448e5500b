"""Adapter residency at TP > 1: rank 0 decides, every other rank follows by adapter id.

Rank 0's AdapterResidency (engine/adapters/residency.py) makes every residency decision
(slots, LRU, pins, host copies, disk reads checked against each version's digest) and validates every
adapter on its own shard before the workers are involved. Its `AdapterMirror` turns the
outcome into ops for the workers' next step plan, applied before that step's forward pass:

    SLOT_LOAD(slot, id)   copy the version into the slot
    HOST_DROP(id)         rank 0 let go of its host copy (LRU): drop this rank's copy too
    RETIRE(id)            the version is gone for good: drop its copy and its path

plus, before the first load of a version, ADD_ADAPTER(id, path, version): where its files
are and the content version rank 0 read there.
A worker's `ShardCache` reads its shard of a version from that path on the first load
it lacks a copy for, so a host copy rank 0 evicted and read back from disk is simply read
again. Ids are per loaded weights and never reused, and a worker refuses files that hash
otherwise, so an id always names the bytes rank 0 validated.
"""
from __future__ import annotations

from typing import Callable

from loramux_engine.distributed.plan import HOST_DROP, RETIRE, SLOT_LOAD


class AdapterMirror:
    """Rank 0: the residency observer that queues the workers' adapter ops."""

    def __init__(self, executor, registry):
        self._exec = executor
        self._registry = registry
        self._announced: set[int] = set()   # ids whose path the workers know

    def slot_loaded(self, slot: int, adapter_id: int) -> None:
        if adapter_id not in self._announced:
            self._announced.add(adapter_id)
            rec = self._registry.get(adapter_id)
            self._exec.queue_add(adapter_id, rec.path, rec.version)
        self._exec.queue_op(SLOT_LOAD, slot, adapter_id)

    def host_dropped(self, adapter_id: int) -> None:
        if adapter_id in self._announced:   # otherwise the workers never read it
            self._exec.queue_op(HOST_DROP, -1, adapter_id)

    def retired(self, adapter_id: int) -> None:
        if adapter_id in self._announced:
            self._announced.discard(adapter_id)
            self._exec.queue_op(RETIRE, -1, adapter_id)


class ShardCache:
    """A worker's host copies of its adapter shards, keyed by adapter id.

    `read(path, version)` reads this rank's shard (load_lora(tp=...)); it holds at most
    the copies rank 0 holds, since every host eviction on rank 0 reaches it as HOST_DROP."""

    def __init__(self, read: Callable[[str, str], object]):
        self._read = read
        self._paths: dict[int, tuple[str, str]] = {}   # id -> (path, version)
        self._copies: dict[int, object] = {}

    def __len__(self) -> int:
        return len(self._copies)

    def add(self, adapter_id: int, path: str, version: str) -> None:
        self._paths[adapter_id] = (path, version)

    def get(self, adapter_id: int):
        """The copy of `adapter_id`, read from its path first if this rank has none."""
        weights = self._copies.get(adapter_id)
        if weights is None:
            where = self._paths.get(adapter_id)
            assert where is not None, f"slot load of adapter {adapter_id} before its path"
            weights = self._copies[adapter_id] = self._read(*where)
        return weights

    def drop(self, adapter_id: int) -> None:
        self._copies.pop(adapter_id, None)

    def retire(self, adapter_id: int) -> None:
        self._copies.pop(adapter_id, None)
        self._paths.pop(adapter_id, None)
