"""Block pool: reference counts, free list order, eviction of cached free blocks."""
import pytest

from loramux_engine.kv.block_pool import BlockPool
from loramux_engine.kv.prefix_cache import hash_block


def test_allocate_and_free_restores_count():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(5)
    assert pool.num_free_blocks == 3
    assert all(b.ref_cnt == 1 for b in blocks)
    assert len({b.block_id for b in blocks}) == 5
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 8
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    pool.check_invariants()


def test_over_allocation_is_refused_without_change():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(ValueError, match="asked for 2 blocks, 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_shared_block_freed_only_at_last_reference():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert pool.num_free_blocks == 3
    pool.free_blocks([b])
    assert pool.num_free_blocks == 4
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free_blocks([b])


def test_cached_free_block_stays_matchable_until_reused():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    key = hash_block(0, None, [1, 2, 3, 4])
    pool.cache_full_block(a, key)
    pool.free_blocks([b, a])  # b freed first: b is the least recently freed
    assert pool.get_cached_block(key) is a
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.get_cached_block(key) is a  # LRU: plain b goes first
    (second,) = pool.get_new_blocks(1)
    assert second is a and a.block_hash is None
    assert pool.get_cached_block(key) is None  # evicted when reused
    pool.check_invariants()


def test_touch_revives_cached_free_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    key = hash_block(0, None, [7] * 4)
    pool.cache_full_block(a, key)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([pool.get_cached_block(key)])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_duplicate_key_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    key = hash_block(3, None, [5, 6])
    pool.cache_full_block(a, key)
    pool.cache_full_block(b, key)
    assert pool.get_cached_block(key) is a and b.block_hash is None
    pool.check_invariants()


def test_evict_namespace_spares_other_namespaces_and_held_blocks_free_later():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    ka, kb, kc = (hash_block(ns, None, [1, 2]) for ns in (5, 5, 6))
    kb = hash_block(5, ka, [3, 4])
    for blk, key in ((a, ka), (b, kb), (c, kc)):
        pool.cache_full_block(blk, key)
    pool.free_blocks([a, c])  # b is still held by a running request
    assert pool.evict_namespace(5) == 2
    assert pool.get_cached_block(ka) is None and pool.get_cached_block(kb) is None
    assert pool.get_cached_block(kc) is c  # namespace 6 untouched
    assert b.ref_cnt == 1 and b.block_hash is None
    pool.free_blocks([b])
    assert pool.num_free_blocks == 4
    pool.check_invariants()
