"""The version digest of adapter files (loramux_core/file_digest.py): BLAKE3 chunks under
a v2 tag, the same whatever the thread count, never equal to the v1 (sha256 chunks) or
plain sha256 digests of the same bytes, which are spelled out here independently."""
from __future__ import annotations

import hashlib
import random

import pytest
from blake3 import blake3

from tests.support import digests
from loramux_core.file_digest import (CHUNK, CURRENT, LEGACY, V1, FileRead, combined_version,
                                      file_digest, file_digest_v1, legacy_sha256)

SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 7]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("threads", [2, 3, 8])
def test_chunks_hashed_on_threads_equal_the_single_threaded_digest(size, threads):
    data = random.Random(size).randbytes(size)
    one = file_digest(data, 1)
    assert one == digests.v2(data)
    assert file_digest(data, threads) == one
    assert file_digest(bytearray(data), threads) == file_digest(memoryview(data), 1) == one
    assert file_digest_v1(data, threads) == file_digest_v1(data, 1) == digests.v1(data)


@pytest.mark.parametrize("size", SIZES)
def test_v2_differs_from_v1_and_plain_sha256_for_the_same_bytes(size):
    data = random.Random(size).randbytes(size)
    seen = {file_digest(data), file_digest_v1(data), legacy_sha256(data)}
    assert len(seen) == 3
    files = [("adapter_config.json", FileRead(b"{}", [blake3(b"{}").digest()])),
             ("adapter_model.safetensors", FileRead(data, _chunk_digests(data)))]
    versions = [combined_version(files, s) for s in (CURRENT, V1, LEGACY)]
    assert len(set(versions)) == 3
    assert versions[0] == combined_version(files)
    assert versions[1] == _combined({"adapter_config.json": digests.v1(b"{}"),
                                     "adapter_model.safetensors": digests.v1(data)})
    assert versions[2] == _combined({"adapter_config.json": hashlib.sha256(b"{}").hexdigest(),
                                     "adapter_model.safetensors": hashlib.sha256(data).hexdigest()})


def test_a_changed_byte_changes_every_digest():
    data = random.Random(5).randbytes(2 * CHUNK + 3)
    for at in (0, CHUNK, len(data) - 1):
        changed = bytearray(data)
        changed[at] ^= 1
        for fn in (file_digest, file_digest_v1, legacy_sha256):
            assert fn(changed) != fn(data)


def _chunk_digests(data: bytes) -> list[bytes]:
    return [blake3(data[o:o + CHUNK]).digest() for o in range(0, max(len(data), 1), CHUNK)]


def _combined(digests: dict[str, str]) -> str:
    h = hashlib.sha256()
    for name, digest in digests.items():
        h.update(f"{name}\0{digest}\n".encode())
    return h.hexdigest()
