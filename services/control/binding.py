"""What a persisted registry belongs to: the base model (a fingerprint of its directory)
and the adapter roots. A registry written for one binding is never replayed under another.

The registry file carries its binding. Opened under a different one, the file is set aside
as `<db>.<its binding key>` (every adapter in it logged as skipped) and the file set aside
for the new binding, if any, comes back: switching models back and forth keeps each
model's adapters and never mixes them."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import struct
from dataclasses import dataclass
from pathlib import Path

_WEIGHT_INDEXES = ("model.safetensors.index.json",)
_MAX_HEADER = 100 * 1024 * 1024  # a safetensors header larger than this is not one
_SAMPLES, _SAMPLE_BYTES = 16, 4096


@dataclass(frozen=True)
class Binding:
    model_fingerprint: str
    adapter_roots: tuple[str, ...]  # realpaths, sorted

    @property
    def key(self) -> str:
        """A short file-name-safe digest of the whole binding."""
        raw = json.dumps([self.model_fingerprint, list(self.adapter_roots)])
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps({"model": self.model_fingerprint, "adapter_roots": list(self.adapter_roots)})

    @classmethod
    def from_json(cls, text: str) -> "Binding":
        d = json.loads(text)
        return cls(d["model"], tuple(d["adapter_roots"]))


def _safetensors_digest(path: Path) -> bytes:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets) and
    _SAMPLES evenly spaced slices of its data: two fine-tunes of one architecture differ
    there, and a multi-GB file costs a few reads, not a full hash."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return head
        (n,) = struct.unpack("<Q", head)
        parts = [f.read(min(n, _MAX_HEADER))]
        start = 8 + n
        span = max(size - start - _SAMPLE_BYTES, 0)
        for i in range(_SAMPLES):
            f.seek(start + span * i // (_SAMPLES - 1))
            parts.append(f.read(_SAMPLE_BYTES))
    return b"".join(parts)


def model_fingerprint(model_dir: str) -> str:
    """sha256 over the model's config.json, its weight index and every safetensors file's
    name, size, header and sampled data. Content, not location: a copy of a model has the
    same one."""
    root = Path(model_dir)
    h = hashlib.sha256()
    for name in ("config.json", *_WEIGHT_INDEXES):
        p = root / name
        if p.is_file():
            h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    for p in sorted(root.glob("*.safetensors")):
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode() + _safetensors_digest(p))
    return h.hexdigest()


def binding_for(model_dir: str, adapter_roots: list[str]) -> Binding:
    return Binding(model_fingerprint(model_dir),
                   tuple(sorted({os.path.realpath(r) for r in adapter_roots})))


def stored_binding(db: str) -> Binding | None:
    """The binding recorded in the registry file `db`, or None (no file, or a file written
    before registries were bound)."""
    if not os.path.exists(db):
        return None
    con = sqlite3.connect(db)
    try:
        row = con.execute("SELECT value FROM meta WHERE key = 'binding'").fetchone()
    except sqlite3.OperationalError:  # no meta table
        row = None
    finally:
        con.close()
    return Binding.from_json(row[0]) if row else None


def stored_adapters(db: str) -> list[tuple[str, str, int]]:
    """(name, path, state) of every adapter in the registry file `db`."""
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT name, path, state FROM adapters ORDER BY name").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()


def _move(src: str, dst: str) -> None:
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(src + suffix):
            os.replace(src + suffix, dst + suffix)
        elif os.path.exists(dst + suffix):
            os.remove(dst + suffix)


def prepare(db: str, binding: Binding, log) -> None:
    """Make `db` the registry of `binding` before it is opened: a registry file bound to
    anything else (or to nothing) is set aside and what it held is logged as skipped; the
    registry earlier set aside for `binding`, if any, is put back."""
    if not os.path.exists(db):
        _restore(db, binding, log)
        return
    old = stored_binding(db)
    if old == binding:
        return
    skipped = stored_adapters(db)
    if not skipped:  # an empty registry of another binding: nothing to keep
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(db + suffix):
                os.remove(db + suffix)
    else:
        aside = f"{db}.{old.key if old else 'unbound'}"
        _move(db, aside)
        log.warning("registry_skipped", reason="bound to another model or adapter roots"
                    if old else "written before registries were bound",
                    old_binding=old.to_json() if old else None, new_binding=binding.to_json(),
                    set_aside=aside, adapters=[{"name": n, "path": p, "state": s}
                                               for n, p, s in skipped])
    _restore(db, binding, log)


def _restore(db: str, binding: Binding, log) -> None:
    aside = f"{db}.{binding.key}"
    if os.path.exists(aside) and stored_binding(aside) == binding:
        _move(aside, db)
        log.info("registry_restored", path=aside, adapters=len(stored_adapters(db)))
