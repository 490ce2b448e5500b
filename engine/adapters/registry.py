"""Adapters known to the engine: one record per loaded weights, keyed by an id.

Ids are monotonic and never reused (0 is the base model). Loading a name again gives a new
id; the name then resolves to the new id while requests admitted under the old id keep
running with the old weights. Retiring an id (unload, or replacement by a reload) is
deferred while requests are in flight: new requests are refused at once, and the id
becomes "ready to free" (slot, host copy, KV namespace) when its last request ends.

    add(name) ──▶ active ──remove(name) / add(name) again──▶ retiring ──in_flight == 0──▶ freed
"""
from __future__ import annotations

from dataclasses import dataclass

from loramux_core.errors import AdapterNotFoundError, AdapterUnavailableError, InvalidRequestError


BASE_ID = 0


@dataclass(eq=False)
class AdapterRecord:
    """One loaded version of an adapter (mutable counters, owned by the registry)."""
    adapter_id: int
    name: str
    path: str
    rank: int
    version: str          # digest of its files when loaded (safe_files): reloads must match
    retiring: bool = False
    in_flight: int = 0    # admitted requests not yet finished (waiting or running)
    loads: int = 0        # copies into a device slot
    evictions: int = 0    # LRU evictions from a device slot
    disk_reads: int = 0   # reads from disk after the first (implicit reloads)
    host_evictions: int = 0  # LRU evictions of the host copy
    cached_token_hits: int = 0


class AdapterRegistry:
    def __init__(self):
        self._next_id = BASE_ID + 1
        self._records: dict[int, AdapterRecord] = {}
        self._current: dict[str, int] = {}  # name -> newest id (active or retiring)
        self._ready: list[AdapterRecord] = []

    @staticmethod
    def check_name(name) -> None:
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequestError(f"adapter name={name!r}: must be a non-empty string")

    def add(self, name: str, path: str, rank: int, version: str) -> int:
        """Register weights already read from `path` under `name`; returns the new id. A
        previous version of the name is retired (freed once its in-flight requests end)."""
        self.check_name(name)
        aid = self._next_id
        self._next_id += 1
        old = self._current.get(name)
        self._records[aid] = AdapterRecord(aid, name, str(path), rank, version)
        self._current[name] = aid
        if old is not None:
            self._retire(old)
        return aid

    def remove(self, name: str) -> int:
        """Retire the current version of `name`; returns its id. Unknown name:
        AdapterNotFoundError. Removing a name already being removed changes nothing."""
        aid = self._current.get(name)
        if aid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        self._retire(aid)
        return aid

    def resolve(self, name: str | None) -> int:
        """Id a new request for `name` runs with (None = base)."""
        if name is None:
            return BASE_ID
        aid = self._current.get(name)
        if aid is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        if self._records[aid].retiring:
            raise AdapterUnavailableError(
                f"adapter {name!r} (id {aid}) is being unloaded; it takes no new requests")
        return aid

    def get(self, adapter_id: int) -> AdapterRecord:
        return self._records[adapter_id]

    def find(self, adapter_id: int) -> AdapterRecord | None:
        return self._records.get(adapter_id)

    def current(self, name: str) -> AdapterRecord | None:
        """Newest version of `name` (active or retiring), or None."""
        aid = self._current.get(name)
        return None if aid is None else self._records[aid]

    @property
    def num_retiring(self) -> int:
        """Retired versions still waiting for their in-flight requests (pending evictions)."""
        return sum(1 for r in self._records.values() if r.retiring)

    def records(self) -> list[AdapterRecord]:
        return list(self._records.values())

    def acquire(self, adapter_id: int) -> None:
        """A request of this id was admitted."""
        if adapter_id != BASE_ID:
            self._records[adapter_id].in_flight += 1

    def release(self, adapter_id: int) -> None:
        """A request of this id finished (or was aborted)."""
        if adapter_id == BASE_ID:
            return
        rec = self._records[adapter_id]
        assert rec.in_flight > 0, f"adapter {adapter_id} released more than acquired"
        rec.in_flight -= 1
        if rec.retiring and rec.in_flight == 0:
            self._ready.append(rec)

    def take_ready(self) -> list[AdapterRecord]:
        """Retired versions with nothing in flight, forgotten now; the caller frees their
        slot and KV namespace."""
        ready, self._ready = self._ready, []
        for rec in ready:
            del self._records[rec.adapter_id]
            if self._current.get(rec.name) == rec.adapter_id:
                del self._current[rec.name]
        return ready

    def retire(self, adapter_id: int) -> None:
        """Retire one version by id (its files can no longer be read back)."""
        self._retire(adapter_id)

    def _retire(self, adapter_id: int) -> None:
        rec = self._records[adapter_id]
        if rec.retiring:
            return
        rec.retiring = True
        if rec.in_flight == 0:
            self._ready.append(rec)
