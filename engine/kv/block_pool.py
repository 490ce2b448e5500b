"""The KV block pool: a fixed number of blocks sized at start, reference counts, a free
list in least-recently-freed order, and the prefix cache over full blocks.

A block is in exactly one of three states:

    in use      ref_cnt > 0                     (never on the free list)
    cached free ref_cnt == 0, has a block hash   (on the free list, still matchable)
    free        ref_cnt == 0, no hash            (on the free list)

Allocation takes blocks from the head of the free list (the least recently freed); a
cached free block taken that way is evicted from the prefix cache first. A cache hit on a
cached free block takes it off the free list again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loramux_engine.kv.prefix_cache import BlockHash, PrefixCache


@dataclass
class Block:
    """One block of the pool (mutable bookkeeping, owned by the pool)."""
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: must be >= 1")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache = PrefixCache()

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free or cached free)."""
        return len(self._free)

    def get_new_blocks(self, n: int) -> list[Block]:
        """Take `n` blocks off the free list (ref_cnt 1 each), evicting cached ones."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            block = self.blocks[self._free.popitem(last=False)[0]]
            assert block.ref_cnt == 0
            self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[Block]) -> None:
        """Take a reference on each block (prefix-cache hits), reviving cached free ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: list[Block]) -> None:
        """Drop one reference on each block. Blocks reaching zero join the tail of the free
        list in the given order, so callers pass a request's blocks tail first: the end of a
        sequence (least likely to be shared) is evicted before its prefix."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed twice"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def get_cached_block(self, key: BlockHash) -> Block | None:
        block_id = self.cache.get(key)
        return None if block_id is None else self.blocks[block_id]

    def cache_full_block(self, block: Block, key: BlockHash) -> None:
        """Make a full, in-use block matchable under `key`. If another block already holds
        that key (two requests computed the same prefix at once), this one stays private."""
        assert block.ref_cnt > 0 and block.block_hash is None
        if self.cache.insert(key, block.block_id):
            block.block_hash = key

    def evict_namespace(self, namespace: int) -> int:
        """Make every block of `namespace` unmatchable; returns how many were cached.
        Free ones become plain free blocks; ones still referenced (running requests) stay
        with their holders and return to the free list as plain blocks when released."""
        keys = self.cache.keys_of(namespace)
        for key in keys:
            self._uncache(self.blocks[self.cache.get(key)])
        return len(keys)

    def _uncache(self, block: Block) -> None:
        if block.block_hash is not None:
            self.cache.remove(block.block_hash)
            block.block_hash = None

    def check_invariants(self) -> None:
        """Internal consistency (tests call this): free list == blocks with ref 0, and
        the cache map and the blocks' hashes agree."""
        free = {b.block_id for b in self.blocks if b.ref_cnt == 0}
        assert free == set(self._free), "free list out of sync with reference counts"
        hashed = {b.block_hash: b.block_id for b in self.blocks if b.block_hash is not None}
        assert len(hashed) == len(self.cache)
        for key, block_id in hashed.items():
            assert self.cache.get(key) == block_id
