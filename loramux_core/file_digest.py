"""The version digest of adapter files: a sha256 over a tag, each file's size and the
BLAKE3 of each 4 MiB chunk, so the chunks hash on several threads (both hashes release
the GIL on long inputs), each as soon as it is read (loramux_core/safe_files.py), and the
caller converts the bytes while the last ones finish. The control plane and the engines
use this one function, so a file changed between registration and load hashes otherwise.

Chunks are BLAKE3 for its cost per byte (about a third of sha256's on one core); the
combining step stays sha256, over a few hundred bytes, so a version is still a sha256
hex string and the fingerprints keep their form. Versions recorded with earlier digests
stay honoured, each checked only when a read's expected version is not the current one:
`file_digest_v1`, the same layout with sha256 chunks, and `legacy_sha256`, the plain
sha256 of the whole file (combined_version's `scheme`)."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from blake3 import blake3

CHUNK = 4 << 20        # read and hashed in pieces of this size
HASH_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
_DIGEST_TAG = b"loramux chunked blake3 v2\n"
# the tag of the v1 digest, also that of the stat fingerprints (unchanged by v2)
_V1_TAG = b"loramux chunked sha256 v1\n"
# combined_version's schemes: the current digest and the two that versions were before
CURRENT, V1, LEGACY = "blake3-v2", "sha256-v1", "sha256-plain"


def file_digest(data, threads: int = 1) -> str:
    """The version digest of a file's bytes: sha256 over a tag, its size and the BLAKE3
    of each CHUNK-byte chunk (what AdapterDir.read computes while reading), chunks
    hashed on `threads` threads."""
    return _chunked(data, threads, chunk_hash, _DIGEST_TAG)


def file_digest_v1(data, threads: int = 1) -> str:
    """The v1 digest of a file's bytes (sha256 chunks; the layout file_digest keeps),
    which versions were recorded with before; combined_version(..., V1) accepts them."""
    return _chunked(data, threads, _chunk_sha256, _V1_TAG)


def legacy_sha256(data) -> str:
    """The plain sha256 of a file's bytes: the digest versions were recorded with before
    chunked digests (combined_version(..., LEGACY) accepts them)."""
    return hashlib.sha256(memoryview(data)).hexdigest()


def _chunked(data, threads: int, hash_chunk: Callable[[memoryview], bytes],
             tag: bytes) -> str:
    view = memoryview(data)
    chunks = [view[o:o + CHUNK] for o in chunk_spans(len(view))]
    if threads <= 1 or len(chunks) == 1:
        return _combine(len(view), map(hash_chunk, chunks), tag)
    with ThreadPoolExecutor(threads) as pool:
        return _combine(len(view), list(pool.map(hash_chunk, chunks)), tag)


def _combine(size: int, chunk_digests, tag: bytes = _DIGEST_TAG) -> str:
    return hashlib.sha256(tag + size.to_bytes(8, "little")
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


def chunk_hash(chunk: memoryview) -> bytes:
    """The digest of one chunk, as file_digest combines it (BLAKE3, 32 bytes)."""
    return blake3(chunk).digest()


def _chunk_sha256(chunk: memoryview) -> bytes:
    return hashlib.sha256(chunk).digest()


def _scheme_digest(scheme: str, fr: FileRead) -> str:
    if scheme == CURRENT:
        return fr.digest
    if scheme == V1:  # a whole file hashed again: the threads make it cheaper
        return file_digest_v1(fr.data, HASH_THREADS)
    if scheme == LEGACY:
        return legacy_sha256(fr.data)
    raise ValueError(f"unknown digest scheme {scheme!r}")


def combined_version(files: list[tuple[str, FileRead]], scheme: str = CURRENT) -> str:
    """One sha256 over (name, digest) of each file: the adapter version. `scheme`: the
    digest of each file, CURRENT (file_digest), or as versions were recorded before:
    V1 (file_digest_v1) or LEGACY (the plain sha256)."""
    h = hashlib.sha256()
    for name, fr in files:
        h.update(f"{name}\0{_scheme_digest(scheme, fr)}\n".encode())
    return h.hexdigest()


FINGERPRINT_PREFIX = "stat-"


def file_fingerprint(config_digest: str, head: bytes, st: os.stat_result,
                     legacy: bool = False) -> str:
    """The version an adapter is registered under before its weights are read: a digest
    over its config's digest (file_digest_v1, as fingerprints were always recorded), the
    weights file's safetensors header and what changes when the file's content does:
    its inode (a file renamed over it), size and mtime (a write). Not the ctime: a chmod,
    chown or new hard link changes only the metadata, and must not fail the first read of
    the bytes registered; not the device number, which differs between hosts mounting
    one share. A first read of files written or replaced since registration is refused
    like any other version mismatch. `legacy`: the fingerprint as recorded before, which
    also covered the ctime (still honoured)."""
    h = hashlib.sha256(_V1_TAG + (b"fingerprint\n" if legacy else b"fingerprint v2\n"))
    h.update(config_digest.encode() + b"\0" + len(head).to_bytes(8, "little") + bytes(head))
    fields = (st.st_ino, st.st_size, st.st_mtime_ns) + ((st.st_ctime_ns,) if legacy else ())
    for v in fields:
        h.update(int(v).to_bytes(16, "little", signed=True))
    return FINGERPRINT_PREFIX + h.hexdigest()
