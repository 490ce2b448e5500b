"""Prefix cache keys and the map from key to cached block.

A full block of tokens is identified by a chain hash over
(namespace, parent block's hash, the block's token ids), where the namespace is the
adapter id the tokens were computed under (0 = base model). Because the namespace is part
of every key, and adapter ids are never reused, K/V computed under adapter A can never be
matched for adapter B, for the base model, or for a later reload of A's name.

    request tokens:  | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial: never cached)
    block hashes:      h0 = H(ns, ROOT, t0..t15)
                                   h1 = H(ns, h0, t16..t31)
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple, Sequence

_ROOT = b"loramux-prefix-root"


class BlockHash(NamedTuple):
    """Key of one full block: the namespace it lives in and the chain digest."""
    namespace: int
    digest: bytes


def hash_block(namespace: int, parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chain hash of one full block. A cryptographic digest, so that two different token
    prefixes never share a key (a collision would serve another prompt's K/V)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(namespace.to_bytes(8, "little", signed=True))
    h.update(parent.digest if parent is not None else _ROOT)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=False) for t in token_ids))
    return BlockHash(namespace, h.digest())


def hash_blocks(namespace: int, token_ids: Sequence[int], block_size: int,
                start: int = 0, parent: BlockHash | None = None) -> list[BlockHash]:
    """Hashes of full blocks `start, start+1, ...` of `token_ids`; `parent` is the hash of
    block `start - 1` (None when start is 0)."""
    out: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash_block(namespace, parent, token_ids[i * block_size:(i + 1) * block_size])
        out.append(parent)
    return out


class PrefixCache:
    """Map from BlockHash to the id of the block holding that K/V, indexed by namespace
    so that all blocks of one adapter can be dropped at once."""

    def __init__(self) -> None:
        self._blocks: dict[BlockHash, int] = {}
        self._by_namespace: dict[int, set[BlockHash]] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def get(self, key: BlockHash) -> int | None:
        return self._blocks.get(key)

    def insert(self, key: BlockHash, block_id: int) -> bool:
        """Record `block_id` under `key`; False (nothing changed) if the key is taken."""
        if key in self._blocks:
            return False
        self._blocks[key] = block_id
        self._by_namespace.setdefault(key.namespace, set()).add(key)
        return True

    def remove(self, key: BlockHash) -> None:
        del self._blocks[key]
        keys = self._by_namespace[key.namespace]
        keys.discard(key)
        if not keys:
            del self._by_namespace[key.namespace]

    def keys_of(self, namespace: int) -> list[BlockHash]:
        return list(self._by_namespace.get(namespace, ()))

    def namespaces(self) -> list[int]:
        return list(self._by_namespace)
