"""Scheduler with a fake runner (tokens are a function of the context): adapter cap,
deferral, chunked-prefill budget, preemption order and resume, abort, slot eviction."""
import pytest

from loramux_engine.adapters.slots import SlotTable
from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_engine.output_processor import token_stop
from loramux_engine.outputs import FinishReason
from loramux_engine.request import Request, RequestStatus
from loramux_engine.scheduler import Sampled, Scheduler, SchedulerConfig
from loramux_core.sampling import SamplingParams

BS = 4
VOCAB = 1000


def make(num_blocks=64, max_loras=2, budget=32, max_num_seqs=16):
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_loras=max_loras)
    return Scheduler(cfg, KVCacheManager(num_blocks, BS), SlotTable(max_loras))


_arrival = iter(range(10**9))


def req(rid, n_prompt, adapter=0, max_tokens=4, first=1):
    return Request(rid, list(range(first, first + n_prompt)),
                   SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                   adapter_id=adapter, arrival=next(_arrival))


def next_token(r: Request) -> int:
    return (sum(r.all_token_ids) * 31 + r.num_tokens) % VOCAB


def bring_in(s: Scheduler) -> None:
    """What the engine's residency manager does after each schedule, with synchronous
    copies: slots for waiting adapters in priority order, never evicting running ones."""
    protected = s.running_adapters()
    for aid in s.wanted_adapters():
        if s.slots.assign(aid, protected) is None:
            break
        s.slots.mark_ready(aid)
        protected.add(aid)


def step(s: Scheduler):
    """One step with invariant checks; returns the scheduler output. Adapters are
    brought in before it too (as if copied in the background during the previous step)."""
    bring_in(s)
    out = s.schedule()
    bring_in(s)
    batch_adapters = {x.request.adapter_id for x in out.scheduled} - {0}
    assert len(batch_adapters) <= s.cfg.max_loras
    assert len(s.running_adapters()) <= s.cfg.max_loras
    assert out.num_tokens <= s.cfg.max_num_batched_tokens
    assert len(s.running) <= s.cfg.max_num_seqs
    for x in out.scheduled:
        aid = x.request.adapter_id
        assert x.slot == (-1 if aid == 0 else s.slots.slot_of(aid))
        needed = -(-(x.start + x.num_new_tokens) // BS)
        assert len(x.block_ids) >= needed
    sampled = {x.request.request_id: Sampled(next_token(x.request), -0.5)
               for x in out.scheduled if x.samples}
    for r in s.update(out, sampled):  # the engine's output processor decides stops
        reason = token_stop(r, frozenset(), max_model_len=1 << 30)
        if reason is not None:
            s.finish(r, reason)
    s.kv.pool.check_invariants()
    return out


def run_all(s: Scheduler, max_steps=500):
    steps = []
    while s.has_unfinished():
        steps.append(step(s))
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def assert_idle(s: Scheduler):
    assert not s.running and not s.waiting
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in s.kv.pool.blocks)


def test_adapter_cap_defers_never_drops():
    s = make(max_loras=2)
    reqs = [req(f"r{i}", 5, adapter=a) for i, a in enumerate([1, 2, 3, 0, 1, 3, 4, 0])]
    for r in reqs:
        s.add(r)
    first = step(s)
    ids = [x.request.request_id for x in first.scheduled]
    # the slots go to adapters 1 and 3 (two waiting requests each: engine/scheduler.py,
    # batch composition); 2 and 4 are over the cap of 2
    assert ids == ["r0", "r2", "r3", "r4", "r5", "r7"]
    assert [r.request_id for r in s.waiting] == ["r1", "r6"]  # deferred, order kept
    run_all(s)
    assert all(r.finish_reason == FinishReason.LENGTH and r.num_output_tokens == 4 for r in reqs)
    assert_idle(s)


def test_base_requests_pass_deferred_adapter_requests():
    s = make(max_loras=1)
    for r in (req("a", 3, 1), req("b", 3, 2), req("c", 3, 0), req("d", 3, 2)):
        s.add(r)
    out = step(s)
    # the slot goes to adapter 2 (two waiting requests); the base request passes "a"
    assert [x.request.request_id for x in out.scheduled] == ["b", "c", "d"]
    assert [r.request_id for r in s.waiting] == ["a"]


def test_failed_allocation_takes_no_slot_and_no_cap():
    s = make(num_blocks=6, max_loras=2)
    s.add(req("small", 8, adapter=1, max_tokens=8))  # 2 blocks, 4 with its decodes
    step(s)
    s.add(req("big", 17, adapter=2))                # needs 5 blocks: cannot fit now
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["small"]
    assert s.running_adapters() == {1}  # the failed attempt did not count toward the cap
    assert s.get("big").status is RequestStatus.WAITING
    # adapter 2 waits in a slot, but as it is not running, a third adapter still fits
    # under the cap of 2 once big is gone
    s.abort("big")
    s.add(req("other", 1, adapter=3))
    out = step(s)
    assert {x.request.adapter_id for x in out.scheduled} == {1, 3}


def test_chunked_prefill_respects_budget_and_decodes_go_first():
    s = make(budget=8)
    s.add(req("dec", 2, max_tokens=10))
    step(s)  # prefill of "dec" (2 tokens), now decoding
    s.add(req("long", 21, first=100))
    chunks = []
    while s.get("long") is not None and s.get("long").num_output_tokens == 0:
        out = step(s)
        assert out.scheduled[0].request.request_id == "dec"  # decode first
        chunks += [x.num_new_tokens for x in out.scheduled if x.request.request_id == "long"]
    assert chunks == [7, 7, 7]  # 1 decode + 7 prefill tokens per 8-token step
    run_all(s)
    assert_idle(s)


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 2))
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2
    run_all(s)
    assert_idle(s)


def reference_outputs(prompts):
    s = make(num_blocks=256)
    reqs = [req(rid, n, a, max_tokens=12, first=f) for rid, n, a, f in prompts]
    for r in reqs:
        s.add(r)
    run_all(s)
    return {r.request_id: r.output_token_ids for r in reqs}


def test_preemption_newest_first_resumes_and_rematches_own_blocks():
    prompts = [("old", 9, 1, 1), ("mid", 9, 2, 50), ("new", 9, 1, 200)]
    expected = reference_outputs(prompts)
    s = make(num_blocks=14)  # each request needs 6 blocks at the end: 18 > 14
    reqs = [req(rid, n, a, max_tokens=12, first=f) for rid, n, a, f in prompts]
    for r in reqs:
        s.add(r)
    preempted = []
    while s.has_unfinished():
        out = step(s)
        preempted += out.preempted
        assert len(preempted) < 50
    assert preempted and preempted[0] == "new"  # the newest goes first
    assert {r.request_id: r.output_token_ids for r in reqs} == expected
    victims = [r for r in reqs if r.num_preemptions]
    assert any(r.num_resumed_cached_tokens > 0 for r in victims)
    assert_idle(s)


def test_preempted_request_goes_to_front_of_waiting():
    s = make(num_blocks=5)
    a, b = req("a", 7, max_tokens=8), req("b", 7, max_tokens=8, first=30)
    s.add(a)
    s.add(b)
    step(s)
    s.add(req("c", 3, first=60))
    while not b.num_preemptions:
        step(s)
    assert s.waiting[0] is b


def test_abort_running_and_waiting_frees_everything():
    s = make(num_blocks=8, max_num_seqs=1)
    a, b = req("a", 9, adapter=1, max_tokens=20), req("b", 5)
    s.add(a)
    s.add(b)
    step(s)
    assert a.status is RequestStatus.RUNNING and b.status is RequestStatus.WAITING
    assert s.abort("b") is b and s.abort("a") is a
    assert a.finish_reason == b.finish_reason == FinishReason.ABORTED
    assert s.abort("a") is None
    assert s.running_adapters() == set()
    assert_idle(s)


def test_slot_eviction_spares_busy_adapters():
    s = make(max_loras=2)
    s.add(req("a1", 3, adapter=1, max_tokens=30))
    s.add(req("b2", 3, adapter=2, max_tokens=1))
    step(s)  # b2 finishes after one token; adapter 2 stays resident but idle
    assert s.slots.resident().keys() == {1, 2}
    slot1 = s.slots.slot_of(1)
    s.add(req("c3", 3, adapter=3))
    out = step(s)
    assert s.slots.resident().keys() == {1, 3}  # LRU among idle ones; 1 is busy
    assert s.slots.slot_of(1) == slot1
    assert [x.request.request_id for x in out.scheduled] == ["a1", "c3"]


@pytest.mark.parametrize("stop_kind", ["token", "length"])
def test_finish_reasons(stop_kind):
    s = make()
    r = req("r", 3, max_tokens=5)
    if stop_kind == "token":
        probe = req("probe", 3)
        s.add(probe)
        step(s)
        first_tok = probe.output_token_ids[0]
        s.abort("probe")
        r = Request("r", list(range(1, 4)), SamplingParams(
            temperature=0.0, max_tokens=5, stop_token_ids=[first_tok]), arrival=next(_arrival))
    s.add(r)
    run_all(s)
    assert r.finish_reason == (FinishReason.STOP if stop_kind == "token" else FinishReason.LENGTH)
    assert r.num_output_tokens == (1 if stop_kind == "token" else 5)
