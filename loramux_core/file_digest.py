"""The version digest of adapter files: a sha256 over each file's size and the sha256 of
each 4 MiB chunk, so the chunks hash on several threads (hashlib releases the GIL), each as
soon as it is read (loramux_core/safe_files.py), and the caller converts the bytes while
the last ones finish. The control plane and the engines use this one function, so a file
changed between registration and load hashes otherwise. `legacy_sha256` is the plain
sha256 that versions were before, to honour versions recorded then."""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor

CHUNK = 4 << 20        # read and hashed in pieces of this size
HASH_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
_DIGEST_TAG = b"loramux chunked sha256 v1\n"


def file_digest(data, threads: int = 1) -> str:
    """The version digest of a file's bytes: sha256 over its size and the sha256 of each
    CHUNK-byte chunk (what AdapterDir.read computes while reading), chunks hashed on
    `threads` threads."""
    view = memoryview(data)
    chunks = [view[o:o + CHUNK] for o in chunk_spans(len(view))]
    if threads <= 1 or len(chunks) == 1:
        return _combine(len(view), map(chunk_sha256, chunks))
    with ThreadPoolExecutor(threads) as pool:
        return _combine(len(view), list(pool.map(chunk_sha256, chunks)))


def legacy_sha256(data) -> str:
    """The plain sha256 of a file's bytes: the digest versions were recorded with before
    file_digest (combined_version(..., legacy=True) accepts them)."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def _combine(size: int, chunk_digests) -> str:
    return hashlib.sha256(_DIGEST_TAG + size.to_bytes(8, "little")
                          + b"".join(chunk_digests)).hexdigest()


class FileRead:
    """The bytes of one file (`data`, exactly the file's size; the buffer read into,
    handed over, not copied: readers never write it) and their digest, which may still
    be computing on other threads (`digest` waits for it)."""

    def __init__(self, data: bytearray | memoryview, chunks: list[Future] | list[bytes],
                 stat: os.stat_result | None = None):
        self.data = data
        self._chunks = chunks
        self._digest: str | None = None
        self.stat = stat   # the file's stat as read (file_fingerprint), when known

    @property
    def digest(self) -> str:
        """file_digest(data)."""
        if self._digest is None:
            parts = [c.result() if isinstance(c, Future) else c for c in self._chunks]
            self._digest = _combine(len(self.data), parts)
        return self._digest


def chunk_spans(size: int) -> range:
    """Start offsets of a file's chunks (one, empty, for an empty file)."""
    return range(0, max(size, 1), CHUNK)


def chunk_sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def combined_version(files: list[tuple[str, FileRead]], legacy: bool = False) -> str:
    """One sha256 over (name, digest) of each file: the adapter version. `legacy`: over
    each file's plain sha256, as versions were recorded before file_digest."""
    h = hashlib.sha256()
    for name, fr in files:
        digest = legacy_sha256(fr.data) if legacy else fr.digest
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()


FINGERPRINT_PREFIX = "stat-"


def file_fingerprint(config_digest: str, head: bytes, st: os.stat_result,
                     legacy: bool = False) -> str:
    """The version an adapter is registered under before its weights are read: a digest
    over its config's digest, the weights file's safetensors header and what changes
    when the file's content does: its inode (a file renamed over it), size and mtime (a
    write). Not the ctime: a chmod, chown or new hard link changes only the metadata, and
    must not fail the first read of the bytes registered; not the device number, which
    differs between hosts mounting one share. A first read of files written or replaced
    since registration is refused like any other version mismatch. `legacy`: the
    fingerprint as recorded before, which also covered the ctime (still honoured)."""
    h = hashlib.sha256(_DIGEST_TAG + (b"fingerprint\n" if legacy else b"fingerprint v2\n"))
    h.update(config_digest.encode() + b"\0" + len(head).to_bytes(8, "little") + bytes(head))
    fields = (st.st_ino, st.st_size, st.st_mtime_ns) + ((st.st_ctime_ns,) if legacy else ())
    for v in fields:
        h.update(int(v).to_bytes(16, "little", signed=True))
    return FINGERPRINT_PREFIX + h.hexdigest()
