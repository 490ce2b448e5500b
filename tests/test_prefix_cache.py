"""Prefix cache through the KV cache manager: namespaces never cross, the last token is
always computed, refcounts of shared blocks, decode-time insertion, resume re-matching."""
from dataclasses import dataclass, field

import pytest

from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_engine.kv.prefix_cache import hash_block, hash_blocks

BS = 4


@dataclass
class Req:  # the three fields the manager reads; a Request stand-in for unit tests
    request_id: str
    tokens: list
    adapter_id: int = 0
    num_computed_tokens: int = 0

    @property
    def all_token_ids(self):
        return self.tokens


def run_prefill(kv, req):
    """What the scheduler does on admission: match, allocate, mark computed."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, len(req.tokens) - n_hit, hits) is not None
    req.num_computed_tokens = len(req.tokens)
    return n_hit


def test_hash_depends_on_namespace_parent_and_tokens():
    base = hash_block(0, None, [1, 2, 3, 4])
    assert base == hash_block(0, None, [1, 2, 3, 4])
    assert base != hash_block(1, None, [1, 2, 3, 4])
    assert base != hash_block(0, None, [1, 2, 3, 5])
    assert hash_block(0, base, [1, 2, 3, 4]) != base
    chain = hash_blocks(2, list(range(10)), BS)
    assert len(chain) == 2 and chain[1] == hash_block(2, chain[0], [4, 5, 6, 7])


def test_same_tokens_other_namespace_never_match():
    kv = KVCacheManager(16, BS)
    prompt = list(range(13))
    a = Req("a", prompt, adapter_id=7)
    assert run_prefill(kv, a) == 0
    for rid, ns in (("b", 8), ("base", 0)):
        assert kv.get_computed_blocks(Req(rid, prompt, adapter_id=ns)) == ([], 0)
    hits, n = kv.get_computed_blocks(Req("a2", prompt, adapter_id=7))
    assert n == 12 and [h.block_id for h in hits] == kv.block_ids("a")[:3]


def test_last_token_is_never_cached():
    kv = KVCacheManager(16, BS)
    prompt = list(range(8))  # exactly two full blocks
    run_prefill(kv, Req("a", prompt))
    hits, n = kv.get_computed_blocks(Req("b", prompt))
    assert n == 4 and len(hits) == 1  # the second block holds the last token


def test_shared_blocks_refcounts_and_free_restores_pool():
    kv = KVCacheManager(10, BS)
    prompt = list(range(9))
    a, b = Req("a", prompt, 3), Req("b", prompt, 3)
    run_prefill(kv, a)
    assert run_prefill(kv, b) == 8
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.num_free_blocks == 10 - 4  # 3 for a, 1 new for b
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 10
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    kv.pool.check_invariants()


def test_block_filled_by_decode_is_cached_in_request_namespace():
    kv = KVCacheManager(8, BS)
    a = Req("a", list(range(6)), adapter_id=4)
    run_prefill(kv, a)
    for tok in (100, 101):  # decode two tokens: block 1 becomes full with 100, 101
        a.tokens.append(tok)
        assert kv.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    # tokens 0..7 now cached; a prompt extending them matches both blocks under ns 4 only
    probe = list(range(6)) + [100, 101, 55]
    assert kv.get_computed_blocks(Req("p", probe, adapter_id=4))[1] == 8
    assert kv.get_computed_blocks(Req("q", probe, adapter_id=0))[1] == 0


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(3, BS)
    run_prefill(kv, Req("a", list(range(8))))  # 2 blocks
    big = Req("b", list(range(100, 109)))      # needs 3
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(big, 9) is None
    assert kv.num_free_blocks == free_before and kv.block_ids("b") == []
    kv.pool.check_invariants()


def test_cached_free_hits_count_against_free_blocks():
    kv = KVCacheManager(3, BS)
    a = Req("a", list(range(9)))
    run_prefill(kv, a)  # 3 blocks, two of them full and cached
    kv.free(a)
    assert kv.num_free_blocks == 3
    again = Req("a'", list(range(9)))
    hits, n = kv.get_computed_blocks(again)
    assert n == 8
    assert kv.allocate_slots(again, 1, hits) is not None
    assert kv.num_free_blocks == 0
    kv.pool.check_invariants()


def test_freed_request_rematches_its_own_blocks_on_resume():
    kv = KVCacheManager(8, BS)
    a = Req("a", list(range(10)), adapter_id=9)
    run_prefill(kv, a)
    a.tokens += [50, 51]  # two decoded tokens: 12 tokens, 3 full blocks
    assert kv.allocate_slots(a, 2) is not None
    kv.free(a)  # preemption
    a.num_computed_tokens = 0
    hits, n = kv.get_computed_blocks(a)
    assert n == 8  # 12 tokens, last block holds the last token, so 2 blocks re-match
    assert kv.allocate_slots(a, 4, hits) is not None


def test_evict_namespace_drops_only_that_adapter():
    kv = KVCacheManager(16, BS)
    prompt = list(range(9))
    for rid, ns in (("a", 1), ("b", 2)):
        r = Req(rid, prompt, ns)
        run_prefill(kv, r)
        kv.free(r)
    assert kv.evict_namespace(1) == 2
    assert kv.get_computed_blocks(Req("a2", prompt, 1))[1] == 0
    assert kv.get_computed_blocks(Req("b2", prompt, 2))[1] == 8
    kv.pool.check_invariants()


def test_prefix_caching_disabled_matches_nothing():
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    run_prefill(kv, Req("a", list(range(9))))
    assert kv.get_computed_blocks(Req("b", list(range(9)))) == ([], 0)
    assert len(kv.pool.cache) == 0


@pytest.mark.parametrize("n_blocks", [1, 2])
def test_pool_exactly_full(n_blocks):
    kv = KVCacheManager(n_blocks, BS)
    r = Req("a", list(range(BS * n_blocks)))
    assert kv.allocate_slots(r, BS * n_blocks) is not None
    assert kv.num_free_blocks == 0
    r.num_computed_tokens = BS * n_blocks
    r.tokens.append(1)
    assert kv.allocate_slots(r, 1) is None
