"""Async scheduling under tensor parallelism (two gloo ranks on the CPU, async_scheduling=True)
against the same engine on one rank in sync mode: token for token and logprobs within 1e-5,
on the Llama and Qwen2 test models, for a mixed batch of adapters of different ranks and
base requests with chunked prefill, slot eviction and preemption; for a mix of greedy and
sampled requests with stop strings, stop tokens, n > 1, top logprobs, a repetition
penalty (its steps fall back to sync) and aborts; through the adapter lifecycle; with
nothing leaked at idle; and proof that TP steps really overlap (step N+1 launched before
step N's update on rank 0), greedy steps and sampled ones alike (rank 0's sampled tokens
reach the worker's device by a broadcast). A worker killed while a step is in flight is
in tests/test_tp_failures.py.

The worker side of a placeholder is also checked in-process: a worker's runner fed plans
with in-flight tokens fills them from its own picked tokens at the row rank 0 uses, and
writes the KV rank 0 writes."""
from __future__ import annotations

import pytest
import torch

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_engine.distributed.mirror import RequestMirror
from loramux_engine.distributed.plan import decode_step, encode_step
from loramux_engine.distributed.tracker import PlanTracker
from loramux_engine.distributed.worker import NoSampling
from loramux_engine.lora import LoRASlotPool
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.request import Request
from loramux_engine.runner import ModelRunner
from loramux_engine.sampling import SamplingState
from loramux_engine.scheduler import ScheduledRequest, SchedulerOutput
from tests.test_engine_async import assert_idle, assert_same, drive, mixed_requests
from tests.test_tp_engine import CFG, MIXED, PROMPTS, lifecycle

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    """(family, TP=1 sync engine, TP=2 async engine), both with the family's adapters."""
    family = request.getfixturevalue(f"{request.param}_family")
    engines = []
    try:
        for tp, mode in ((1, False), (2, True)):
            engines.append(Engine(EngineConfig(model=str(family.model_dir), tp_size=tp,
                                               async_scheduling=mode, **CFG)))
            for name, path in family.adapters.items():
                engines[-1].add_adapter(name, path)
        yield family, *engines
    finally:
        for e in engines:
            e.close()


class Leads:
    """At each of rank 0's scheduler updates: steps launched minus steps updated before it
    (1: only the step being updated was launched; 2: the next one was launched first)."""

    def __init__(self, eng: Engine):
        self.eng, self.lead = eng, []
        update = eng.scheduler.update

        def spy(out, sampled):
            self.lead.append(eng.runner.num_launches - eng.scheduler.num_updates)
            return update(out, sampled)
        eng.scheduler.update = spy

    def __enter__(self) -> list[int]:
        return self.lead

    def __exit__(self, *exc) -> None:
        del self.eng.scheduler.update  # back to the class's method


def both(tp1: Engine, tp2: Engine, requests, abort_after=None):
    """Run `requests` on both engines; same outputs, both idle; rank 0's leads of TP=2."""
    one, _ = drive(tp1, requests, abort_after)
    with Leads(tp2) as lead:
        two, _ = drive(tp2, requests, abort_after)
    assert_same(one, two)
    assert_idle(tp1)
    assert_idle(tp2)
    assert set(lead) <= {1, 2}, lead
    return two, lead


def test_greedy_mixed_batch_matches_tp1_sync_and_overlaps(pair):
    family, tp1, tp2 = pair
    reqs = [(f"g-{i}", p, GREEDY, a) for i, (p, a) in enumerate(zip(PROMPTS, MIXED))]
    seen = {"preempted": False}
    schedule = tp2.scheduler.schedule

    def spy():
        out = schedule()
        seen["preempted"] |= bool(out.preempted)
        return out
    tp2.scheduler.schedule = spy
    try:
        out, lead = both(tp1, tp2, reqs)
    finally:
        del tp2.scheduler.schedule
    assert seen["preempted"], "the KV pool was meant to force preemption"
    assert all(len(o["tokens"]) == GREEDY.max_tokens for o in out.values())
    # every step is all-greedy: all updates but the last overlap the next step (a spare one
    # for a step that preemption leaves empty)
    assert lead.count(2) >= len(lead) - 2, lead


def test_greedy_and_sampled_mix_matches_tp1_sync(pair):
    """Sampled rows and top logprobs overlap like greedy ones, a penalty forces sync
    fallback steps; stops, n > 1 and aborts finish requests while a launched step holds
    them (draining, forgotten by the plan tracker while in flight); the results are still
    those of TP=1 sync."""
    family, tp1, tp2 = pair
    requests = mixed_requests(family)
    requests.append(("pen", PROMPTS[2], SamplingParams(
        temperature=0.0, max_tokens=5, repetition_penalty=1.3, logprobs=True), "ap8"))
    # greedy with the sampling knobs set (they do not change a greedy pick or its raw
    # logprob): still the greedy pick on every rank, same tokens and logprobs
    requests.append(("knobs", PROMPTS[4], SamplingParams(
        temperature=0.0, top_k=3, top_p=0.5, min_p=0.2, seed=9, max_tokens=7, logprobs=True,
        include_stop_str_in_output=True), "attn32"))
    # a greedy request that outlives every other, whatever order the scheduler admits
    # them in: its last steps are all-greedy after sync ones, and must overlap again
    requests.append(("tail", PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True), None))
    out, lead = both(tp1, tp2, requests, abort_after={"m2": 3, "m6": 2, "m7/1": 4})
    assert [len(out[r]["tokens"]) for r in ("m2", "m6", "m7/1")] == [3, 2, 4]
    assert lead.count(1) >= 3, "the penalty's steps were meant to fall back to sync"
    assert lead.count(2) >= 3, "the greedy steps after the penalty's should overlap"


def test_sampled_requests_overlap_and_match_tp1_sync(pair):
    """Only sampled rows (seeded and engine-seeded, top-k/top-p/min-p, top logprobs, n > 1,
    over adapters and base): rank 0 samples, the worker takes its tokens from the
    broadcast for its placeholders; every step but the last overlaps the next, and tokens
    and logprobs are those of TP=1 sync."""
    family, tp1, tp2 = pair
    sp = SamplingParams
    specs = [sp(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=9, logprobs=True),
             sp(temperature=1.0, min_p=0.05, max_tokens=8, top_logprobs=3, ignore_eos=True),
             sp(temperature=0.7, n=2, seed=11, max_tokens=7, logprobs=True, ignore_eos=True),
             sp(temperature=1.2, max_tokens=9, logprobs=True, ignore_eos=True)]
    requests = [(f"s{i}", PROMPTS[i], params, MIXED[i]) for i, params in enumerate(specs)]
    out, lead = both(tp1, tp2, requests)
    assert len(out["s1"]["tokens"]) == 8
    assert lead.count(2) >= len(lead) - 2, lead


def test_adapter_lifecycle_matches_tp1_sync(pair):
    family, tp1, tp2 = pair
    one = lifecycle(tp1, family)
    with Leads(tp2) as lead:
        two = lifecycle(tp2, family)
    assert two == one
    assert lead.count(2) >= 10, lead
    assert_idle(tp1)
    assert_idle(tp2)


# ---- the worker's placeholders, in-process ---------------------------------------------
BS = 4


def _runner(cfg, model_dir, sampler):
    model = LlamaForCausalLM(cfg)
    model.load_weights(model_dir)
    return ModelRunner(model, model.make_kv_caches(32, BS), LoRASlotPool(cfg, 1, 8), BS,
                       "cpu", sampler=sampler)


def test_worker_fills_placeholders_from_its_own_picked_tokens(llama_family):
    """Rank 0 and a worker (full models both: the check is the step plumbing, not the
    sharding) run a greedy prefill, then two decode steps each launched before the
    previous one's tokens are known. The worker's placeholders take its own picked tokens
    (never sent in a plan) at rank 0's rows, so both KV caches end up equal."""
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    rank0 = _runner(cfg, llama_family.model_dir, None)
    worker = _runner(cfg, llama_family.model_dir, NoSampling())
    tracker, mirror = PlanTracker(), RequestMirror()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    reqs = []
    for i, n in enumerate((6, 9, 3)):
        tokens = [3 + (5 * n + 7 * j) % 200 for j in range(n)]
        reqs.append(Request(f"r{i}", tokens, params))
        reqs[-1].sampling_state = SamplingState.create(params, tokens, default_seed=0)
    blocks = {r.request_id: tuple(range(8 * i, 8 * i + 8)) for i, r in enumerate(reqs)}
    prev = wprev = None
    pendings = []
    for step in range(3):
        # a prefill (rows in order 2, 0, 1), then decodes in another order, each running
        # the token the step before is picking (its position: just past the known ones)
        sched = ([(reqs[k], 0, reqs[k].num_tokens) for k in (2, 0, 1)] if not step else
                 [(r, r.num_tokens, 1) for r in (reqs[1], reqs[2], reqs[0])])
        out = SchedulerOutput([ScheduledRequest(r, s, n, blocks[r.request_id], -1, True)
                               for r, s, n in sched])
        greedy = rank0.takes_greedy_pick(out.scheduled, tensor_parallel=True)
        assert greedy, "every row greedy: the eager step takes the greedy pick"
        plan = decode_step(encode_step(tracker.plan(out, [], greedy)))
        if step:  # only the tokens rank 0 has read: none of the step in flight
            assert [len(s.new_tokens) for s in plan.seqs] == [int(step > 1)] * 3
        mirrored = mirror.apply(plan)
        prev = rank0.launch(out, prev, plan.greedy)
        wprev = worker.launch(mirrored, wprev, plan.greedy)
        assert prev.tokens_on_every_rank and wprev.tokens_on_every_rank
        assert [r.sample_row for r in prev.requests] == [r.sample_row for r in wprev.requests]
        assert torch.equal(prev.tokens, wprev.tokens)
        assert wprev.result() == {}
        if step:  # rank 0 reads the previous step's tokens only now (the next plan has them)
            got = pendings[-1].result()
            for r in reqs:
                r.append_token(got[r.request_id].token_id)
        pendings.append(prev)
    picked = [p.result() for p in pendings]
    assert any(s.token_id != 0 for step in picked for s in step.values()), \
        "tokens 0 would look like unfilled placeholders"
    for (ka, va), (kb, vb) in zip(rank0.kv_caches, worker.kv_caches):
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    # the picks are the Sampler's: the same prompts through the sampler path agree
    ref = _runner(cfg, llama_family.model_dir, None)
    out = SchedulerOutput([ScheduledRequest(r, 0, r.num_prompt_tokens, blocks[r.request_id],
                                            -1, True) for r in reqs])
    sampled = ref.run(out)   # one device: the eager path samples with the Sampler
    assert {k: (v.token_id, v.logprob) for k, v in sampled.items()} == \
        {k: (v.token_id, v.logprob) for k, v in picked[0].items()}


@pytest.mark.parametrize("odd,want", [
    (None, True),
    (SamplingParams(temperature=0.7, max_tokens=8), False),          # sampled
    (SamplingParams(temperature=0.0, max_tokens=8, top_logprobs=2), False),
    (SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.2), False),
])
def test_tp_greedy_decision_covers_eager_steps(llama_family, odd, want):
    """Rank 0 decides the greedy pick for a prefill/mixed (eager) step too: every sampling
    row plain greedy; a non-sampling row (a prompt chunk) does not count. A worker never
    decides (no sampler); on one device the eager path keeps sampling with the Sampler."""
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    rank0 = _runner(cfg, llama_family.model_dir, None)
    params = [SamplingParams(temperature=0.0, max_tokens=8)] * 2 + [odd or SamplingParams(
        temperature=0.0, max_tokens=8)]
    reqs = [Request(f"d{i}", [3 + 5 * i + j for j in range(5 + i)], p)
            for i, p in enumerate(params)]
    for r in reqs:
        r.sampling_state = SamplingState.create(r.params, r.prompt_token_ids, default_seed=0)
    out = SchedulerOutput([ScheduledRequest(r, 0, r.num_tokens, tuple(range(8 * i, 8 * i + 8)),
                                            -1, True) for i, r in enumerate(reqs)])
    chunk = SchedulerOutput([*out.scheduled[:2], ScheduledRequest(
        reqs[2], 0, 2, out.scheduled[2].block_ids, -1, False)])  # the odd row only chunks
    assert rank0.takes_greedy_pick(out.scheduled, tensor_parallel=True) is want
    assert rank0.takes_greedy_pick(chunk.scheduled, tensor_parallel=True) is True
    assert rank0.takes_greedy_pick(out.scheduled) is False     # one device, eager: the Sampler
    assert _runner(cfg, llama_family.model_dir, NoSampling()).takes_greedy_pick(
        out.scheduled, tensor_parallel=True) is False
    assert rank0.launch(out).tokens_on_every_rank is False      # TP=1: the Sampler, unchanged
