"""The version digests spelled out from their definition, independently of
loramux_core/file_digest.py, for tests to compare it with: sha256 over a tag, the file's
size and the digest of each 4 MiB chunk (BLAKE3 in v2, sha256 in v1)."""
from __future__ import annotations

import hashlib

from blake3 import blake3

CHUNK = 4 << 20


def chunked(data: bytes, tag: bytes, hash_chunk) -> str:
    parts = [hash_chunk(data[o:o + CHUNK]).digest() for o in range(0, max(len(data), 1), CHUNK)]
    return hashlib.sha256(tag + len(data).to_bytes(8, "little") + b"".join(parts)).hexdigest()


def v2(data: bytes) -> str:
    """The current digest: each chunk's BLAKE3."""
    return chunked(data, b"loramux chunked blake3 v2\n", blake3)


def v1(data: bytes) -> str:
    """The digest versions were recorded with before: each chunk's sha256."""
    return chunked(data, b"loramux chunked sha256 v1\n", hashlib.sha256)
