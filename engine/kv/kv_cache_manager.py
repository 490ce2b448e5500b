"""What the scheduler asks of the KV cache, without knowing the pool.

Per request the manager keeps its block table and the hashes of its full blocks. The
regions of one request's blocks after `allocate_slots(req, n, computed)`:

    | cached hits (computed) | already computed | new tokens this step | lookahead free |
    ^ 0                      ^ hits*bs          ^ req.num_computed      ^ +n
    blocks: [ ... prefix hits ... | ... owned ... | ... newly allocated ... ]

Every full block whose tokens are known (all tokens up to num_computed + n) is inserted
into the prefix cache under the request's adapter id at allocation time; the forward pass
of the same step writes its K/V before any attention reads it (store-then-attend, layer by
layer), so a request matching it in the same step reads valid K/V.
"""
from __future__ import annotations

from typing import Protocol, Sequence

from loramux_engine.kv.block_pool import Block, BlockPool
from loramux_engine.kv.prefix_cache import BlockHash, hash_blocks


class KVRequest(Protocol):
    """The parts of a request the KV manager reads."""
    request_id: str
    adapter_id: int
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> Sequence[int]: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[Block]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # leading blocks already in the cache
        self._ids: dict[str, tuple[int, ...]] = {}  # block table as ids, until it changes

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.block_id_tuple(request_id))

    def block_id_tuple(self, request_id: str) -> tuple[int, ...]:
        """The request's block table as ids; kept between steps while the table does not
        change (a decode step grows it only once per block_size tokens)."""
        ids = self._ids.get(request_id)
        if ids is None:
            ids = tuple(b.block_id for b in self._blocks.get(request_id, ()))
            if request_id in self._blocks:
                self._ids[request_id] = ids
        return ids

    def get_computed_blocks(self, req: KVRequest) -> tuple[list[Block], int]:
        """Longest run of cached full blocks matching the start of the request's tokens in
        its own namespace, and the number of tokens they hold. The last token is never
        counted as computed, so the step that schedules it produces logits."""
        if not self.enable_prefix_caching:
            return [], 0
        assert req.request_id not in self._blocks, "only a request holding no blocks matches"
        tokens = req.all_token_ids
        hashes = self._request_hashes(req)
        max_hits = (len(tokens) - 1) // self.block_size
        hits: list[Block] = []
        for key in hashes[:max_hits]:
            block = self.pool.get_cached_block(key)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, req: KVRequest, num_new_tokens: int,
                       computed_blocks: list[Block] = ()) -> list[Block] | None:
        """Grow the request's block table to hold `num_new_tokens` more tokens after its
        computed ones (and after `computed_blocks`, hits from get_computed_blocks that are
        not yet its own). None, with nothing changed, when the pool is too small."""
        rid = req.request_id
        held = self._blocks.get(rid, [])
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = -(-(num_computed + num_new_tokens) // self.block_size)
        if held and not computed_blocks and need <= len(held):
            # the common decode step: the table already holds the new tokens
            self._cache_full_blocks(req, num_computed + num_new_tokens)
            return []
        num_new_blocks = max(0, need - len(held) - len(computed_blocks))
        # reviving cached free hits takes them off the free list too
        revived = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(list(computed_blocks))
        new = self.pool.get_new_blocks(num_new_blocks)
        blocks = self._blocks.setdefault(rid, [])
        self._ids.pop(rid, None)
        blocks.extend(computed_blocks)
        blocks.extend(new)
        if computed_blocks:
            self._num_cached[rid] = max(self._num_cached.get(rid, 0), len(computed_blocks))
        self._cache_full_blocks(req, num_computed + num_new_tokens)
        return new

    def free(self, req: KVRequest) -> None:
        """Release every block the request holds; full blocks stay cached (matchable in
        its namespace) until evicted. Safe to call on a request holding nothing."""
        rid = req.request_id
        blocks = self._blocks.pop(rid, [])
        self.pool.free_blocks(list(reversed(blocks)))
        self._hashes.pop(rid, None)
        self._num_cached.pop(rid, None)
        self._ids.pop(rid, None)

    def evict_namespace(self, adapter_id: int) -> int:
        """Drop every cached block of an unloaded adapter from the prefix cache (blocks of
        running requests are freed when those requests end). Returns how many."""
        return self.pool.evict_namespace(adapter_id)

    def _request_hashes(self, req: KVRequest) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as its tokens grow."""
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        if len(hashes) < len(tokens) // self.block_size:
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_blocks(req.adapter_id, tokens, self.block_size,
                                      start=len(hashes), parent=parent))
        return hashes

    def _cache_full_blocks(self, req: KVRequest, num_tokens: int) -> None:
        if not self.enable_prefix_caching:
            return
        rid = req.request_id
        # a token still being sampled (async scheduling) is not known: its block is
        # cached by a later allocation, once it is
        num_full = min(num_tokens, len(req.all_token_ids)) // self.block_size
        done = self._num_cached.get(rid, 0)
        if num_full <= done:
            return
        hashes = self._request_hashes(req)
        blocks = self._blocks[rid]
        for i in range(done, num_full):
            if blocks[i].block_hash is None:
                self.pool.cache_full_block(blocks[i], hashes[i])
        self._num_cached[rid] = num_full
