"""The adapter registry: the control plane's desired state, persisted in SQLite.

Every change is one committed transaction (a batch of loads: one for all its items,
before it answers), so a control plane killed at any moment restarts with exactly the
registry its last answered call left."""
from __future__ import annotations

import json
import sqlite3
import time
from dataclasses import dataclass, replace

from loramux.v1 import adapter_admin_pb2 as pb

_SCHEMA = """
CREATE TABLE IF NOT EXISTS adapters (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    state INTEGER NOT NULL,
    pinned INTEGER NOT NULL DEFAULT 0,
    adapter_id INTEGER NOT NULL DEFAULT 0,
    rank INTEGER NOT NULL DEFAULT 0,
    target_modules TEXT NOT NULL DEFAULT '[]',
    loads INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    version TEXT NOT NULL DEFAULT '',
    replicas TEXT NOT NULL DEFAULT '[]'
)"""
_META = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)"
_COLUMNS = ("name", "path", "state", "pinned", "adapter_id", "rank", "target_modules",
            "loads", "created_at", "version", "replicas")
# columns added after the first release: (name, declaration) for files written before them
_ADDED = (("version", "TEXT NOT NULL DEFAULT ''"), ("replicas", "TEXT NOT NULL DEFAULT '[]'"))


@dataclass(frozen=True)
class AdapterRecord:
    """One registry row. `state` is an AdapterState value (REGISTERED/LOADED/UNLOADING)."""
    name: str
    path: str
    state: int = pb.ADAPTER_STATE_REGISTERED
    pinned: bool = False
    adapter_id: int = 0
    rank: int = 0
    target_modules: tuple[str, ...] = ()
    loads: int = 0
    created_at: float = 0.0
    version: str = ""   # digest of the files as validated (loramux_core/file_digest.py)
    replicas: tuple[int, ...] = ()  # engine replicas it is placed on; () = every replica

    def evolve(self, **changes) -> "AdapterRecord":
        return replace(self, **changes)


def _from_row(row: tuple) -> AdapterRecord:
    d = dict(zip(_COLUMNS, row))
    d["pinned"] = bool(d["pinned"])
    d["target_modules"] = tuple(json.loads(d["target_modules"]))
    d["replicas"] = tuple(json.loads(d["replicas"]))
    return AdapterRecord(**d)


def _to_row(rec: AdapterRecord) -> tuple:
    return (rec.name, rec.path, int(rec.state), int(rec.pinned), int(rec.adapter_id),
            int(rec.rank), json.dumps(list(rec.target_modules)), int(rec.loads),
            rec.created_at or time.time(), rec.version, json.dumps(list(rec.replicas)))


class Registry:
    """CRUD over the adapters table. Single writer (the control plane's event loop), so
    reads are answered from a copy in memory (kept with every write) without touching
    SQLite: a lookup costs the same with thousands of names as with one."""

    def __init__(self, path: str, binding: str | None = None):
        """`binding`: what this registry belongs to (services/control/binding.py), recorded
        in the file so that a later start under another model can tell."""
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute(_SCHEMA)
        have = {row[1] for row in self._db.execute("PRAGMA table_info(adapters)")}
        for column, declaration in _ADDED:  # a file written before the column existed
            if column not in have:
                self._db.execute(f"ALTER TABLE adapters ADD COLUMN {column} {declaration}")
        self._db.execute(_META)
        if binding is not None:
            with self._db:
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('binding', ?)", (binding,))
        rows = self._db.execute(f"SELECT {','.join(_COLUMNS)} FROM adapters").fetchall()
        self._records = {rec.name: rec for rec in map(_from_row, rows)}
        self._unloading = {n for n, r in self._records.items()
                           if r.state == pb.ADAPTER_STATE_UNLOADING}
        self._deferred: set[str] = set()  # names whose row waits for `flush`

    def close(self) -> None:
        self._db.close()

    def get(self, name: str) -> AdapterRecord | None:
        return self._records.get(name)

    def page(self, after: str = "", limit: int = 100) -> list[AdapterRecord]:
        """Records ordered by name, strictly after `after`."""
        return [self._records[n] for n in sorted(n for n in self._records if n > after)[:limit]]

    def all(self) -> list[AdapterRecord]:
        return [self._records[n] for n in sorted(self._records)]

    def unloading(self) -> list[AdapterRecord]:
        """The records in state UNLOADING (without looking at the others)."""
        return [self._records[n] for n in sorted(self._unloading)]

    def put(self, rec: AdapterRecord, defer: bool = False) -> AdapterRecord:
        """Insert or replace `rec` (one transaction); returns what was stored. `defer`:
        seen by readers at once, written by the next `flush` (one transaction for many:
        a batch of loads commits once, not twice per adapter)."""
        rec = rec if rec.created_at else rec.evolve(created_at=time.time())
        if defer:
            self._deferred.add(rec.name)
        else:
            self._deferred.discard(rec.name)
            with self._db:
                self._write(rec)
        self._records[rec.name] = rec
        if rec.state == pb.ADAPTER_STATE_UNLOADING:
            self._unloading.add(rec.name)
        else:
            self._unloading.discard(rec.name)
        return rec

    def delete(self, name: str) -> bool:
        self._deferred.discard(name)
        with self._db:
            cur = self._db.execute("DELETE FROM adapters WHERE name = ?", (name,))
        self._records.pop(name, None)
        self._unloading.discard(name)
        return cur.rowcount > 0

    def flush(self) -> None:
        """Write every deferred record as it is now (a later write of the name may have
        replaced it; a deleted one is gone) in one transaction."""
        names, self._deferred = self._deferred, set()
        if not names:
            return
        self._db.execute("BEGIN")
        try:
            for name in sorted(names):
                rec = self._records.get(name)
                if rec is None:
                    self._db.execute("DELETE FROM adapters WHERE name = ?", (name,))
                else:
                    self._write(rec)
        except BaseException:
            self._db.execute("ROLLBACK")
            self._deferred |= names
            raise
        self._db.execute("COMMIT")

    def _write(self, rec: AdapterRecord) -> None:
        self._db.execute(f"INSERT OR REPLACE INTO adapters ({','.join(_COLUMNS)}) "
                         f"VALUES ({','.join('?' * len(_COLUMNS))})", _to_row(rec))
