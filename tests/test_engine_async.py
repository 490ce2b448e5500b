"""Async scheduling (EngineConfig.async_scheduling=True) on the CPU: Hugging Face parity for
a mixed batch; the same tokens, logprobs, texts and finish reasons as sync mode for greedy
and seeded sampling, stop strings, stop tokens and EOS, max_tokens, top logprobs, n > 1,
aborts mid-run, preemption under a tiny KV pool and the repetition-penalty fallback; at
idle every block free or cached and every adapter reference dropped; and proof that steps
really overlap (step N+1 is launched before step N's update)."""
import pytest

from loramux_engine import Engine, EngineConfig, FinishReason, SamplingParams
from loramux_engine.scheduler import Scheduler
from loramux_core.errors import InvalidRequestError
from tests.test_engine_parity import (ADAPTERS, GREEDY, LENGTHS, MAX_NEW, assert_matches,
                                      make_engine, prompts_of)

TOL = 1e-5  # logprobs: the batches of the two modes differ (batch invariance bound)


def make(family, async_scheduling, **kw):
    return make_engine(family, async_scheduling=async_scheduling, **kw)


def drive(eng, requests, abort_after=None, limit=2000):
    """Add `requests` [(id, prompt, params, adapter)], step to the end; abort request id
    `a` once the caller has seen `k` of its tokens, for (a, k) in `abort_after`. Returns
    per sequence id: its tokens, logprobs, top logprobs, text and finish reason as seen
    through StepOutputs, and the Request objects."""
    seen, reqs = {}, {}
    for rid, prompt, params, adapter in requests:
        eng.add_request(rid, prompt, params, adapter)
        for sid in ([rid] if params.n == 1 else [f"{rid}/{i}" for i in range(params.n)]):
            seen[sid] = {"tokens": [], "logprobs": [], "top": [], "text": "", "reason": None}
            reqs[sid] = eng.scheduler.get(sid)
    pending = dict(abort_after or {})
    for _ in range(limit):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            s = seen[o.request_id]
            assert s["reason"] is None, f"{o.request_id}: output after it finished"
            s["tokens"] += o.new_token_ids
            s["logprobs"] += o.new_logprobs
            s["top"] += o.new_top_logprobs
            s["text"] += o.text_delta
            s["reason"] = o.finish_reason if o.finished else None
        for rid, k in list(pending.items()):
            if len(seen[rid]["tokens"]) >= k:
                assert eng.abort(rid)
                seen[rid]["reason"] = FinishReason.ABORTED
                del pending[rid]
    else:
        raise AssertionError("engine made no progress")
    assert not pending, f"never aborted: {pending}"
    return seen, reqs


def assert_same(a, b):
    assert a.keys() == b.keys()
    for rid in a:
        x, y = a[rid], b[rid]
        assert (x["tokens"], x["text"], x["reason"]) == (y["tokens"], y["text"], y["reason"]), rid
        assert len(x["logprobs"]) == len(y["logprobs"]), rid
        assert all(abs(p - q) < TOL for p, q in zip(x["logprobs"], y["logprobs"])), rid
        assert len(x["top"]) == len(y["top"]), rid
        for p, q in zip(x["top"], y["top"]):
            assert p.keys() == q.keys() and all(abs(p[t] - q[t]) < TOL for t in p), rid


def assert_idle(eng):
    """Nothing in flight, every KV block free (or cached), every reference dropped."""
    assert not eng.has_unfinished() and eng.flush() == []
    st = eng.stats()
    assert st["free_kv_blocks"] == st["num_kv_blocks"]
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    assert all(a["in_flight"] == 0 for a in st["adapters"].values())
    assert eng.scheduler.draining() == [] and eng.scheduler.running_adapters() == set()
    eng.kv.pool.check_invariants()


def both(family, requests, abort_after=None, **kw):
    """Run `requests` on a sync and an async engine; check both idle afterwards."""
    results = []
    for mode in (False, True):
        eng = make(family, mode, **kw)
        results.append((eng, *drive(eng, requests, abort_after)))
        assert_idle(eng)
    (_, sync, _), (eng, asyn, reqs) = results
    assert_same(sync, asyn)
    return eng, asyn, reqs


# ---- (a) Hugging Face parity --------------------------------------------------------
def test_mixed_batch_matches_hf(llama_family, llama_oracle):
    eng = make(llama_family, True)
    prompts = prompts_of(LENGTHS, seed=2)
    refs = llama_oracle.generate(prompts, ADAPTERS, MAX_NEW)
    assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
    assert_idle(eng)


def test_fewer_slots_than_adapters_matches_hf(llama_family, llama_oracle):
    eng = make(llama_family, True, max_loras=2)
    prompts = prompts_of(LENGTHS, seed=3)
    refs = llama_oracle.generate(prompts, ADAPTERS, MAX_NEW)
    assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
    assert_idle(eng)


# ---- (b) async == sync --------------------------------------------------------------
def mixed_requests(family):
    """Greedy, seeded and engine-seeded sampling (top-k/top-p/min-p), top logprobs,
    stop strings, stop tokens, EOS, max_tokens 1 and 2, n > 1, over base and adapters."""
    prompts = prompts_of([3, 9, 17, 33, 5, 12, 40, 7, 21], seed=7)
    probe = make(family, False).generate(prompts[:2], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True), ["rs4", None])
    stop_str = probe[0].text[4:7]
    stop_tok = probe[1].token_ids[5]
    assert stop_str and stop_tok not in probe[1].token_ids[:5]
    sp = SamplingParams
    specs = [
        (sp(temperature=0.0, max_tokens=12, stop=[stop_str], logprobs=True), "rs4"),
        (sp(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok], logprobs=True), None),
        (sp(temperature=0.8, top_k=20, top_p=0.9, seed=5, max_tokens=10, logprobs=True), "ap8"),
        (sp(temperature=1.0, min_p=0.05, max_tokens=9, top_logprobs=3), "attn32"),
        (sp(temperature=0.0, max_tokens=1, logprobs=True), "ap8"),
        (sp(temperature=0.0, max_tokens=2, top_logprobs=2), None),
        (sp(temperature=0.0, max_tokens=MAX_NEW, logprobs=True), "rs4"),  # may hit EOS
        (sp(temperature=0.9, n=3, seed=11, max_tokens=7, logprobs=True), "attn32"),
        (sp(temperature=0.0, n=2, max_tokens=6), None),
    ]
    return [(f"m{i}", p, params, name) for i, (p, (params, name)) in enumerate(zip(prompts, specs))]


def spy_finishes(monkeypatch):
    """Record, per finish, whether a launched step still held the request (it drains)."""
    held, build = [], Engine.__init__

    def init(self, config):
        build(self, config)
        inner = self.scheduler.finish

        def spy(req, reason):
            held.append((config.use_async_scheduling, req.num_inflight_steps > 0))
            inner(req, reason)
        self.scheduler.finish = spy
    monkeypatch.setattr(Engine, "__init__", init)
    return held


def test_async_equals_sync_mixed(llama_family, monkeypatch):
    held = spy_finishes(monkeypatch)
    _, out, reqs = both(llama_family, mixed_requests(llama_family))
    assert (True, True) in held and (False, True) not in held  # stops drained in async
    reasons = {o["reason"] for o in out.values()}
    assert {FinishReason.STOP, FinishReason.LENGTH} <= reasons, reasons
    assert out["m0"]["reason"] == FinishReason.STOP and out["m1"]["reason"] == FinishReason.STOP
    assert len(out["m7/0"]["tokens"]) == 7 and out["m7/0"]["tokens"] != out["m7/1"]["tokens"]


def test_async_equals_sync_with_aborts(llama_family):
    requests = mixed_requests(llama_family)
    _, out, _ = both(llama_family, requests, abort_after={"m2": 3, "m6": 1, "m7/1": 4})
    assert [len(out[r]["tokens"]) for r in ("m2", "m6", "m7/1")] == [3, 1, 4]


def test_async_equals_sync_under_preemption(llama_family, monkeypatch):
    """A tiny pool: running requests are preempted; in async mode they are in flight when
    it happens (every running decode is), so their in-flight token is appended first."""
    prompts = prompts_of([9, 12, 10, 11, 8, 12], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=10, ignore_eos=True)] * 3
    names = ["rs4", None, "ap8", "attn32", None, "rs4"]
    requests = [(f"p{i}", pr, pa, n) for i, (pr, pa, n) in enumerate(zip(prompts, params, names))]
    victims = []
    preempt = Scheduler._preempt

    def spy(self, req):
        victims.append(req.num_inflight_tokens)
        preempt(self, req)
    monkeypatch.setattr(Scheduler, "_preempt", spy)
    _, out, reqs = both(llama_family, requests, block_size=4, num_kv_blocks=14,
                        max_num_batched_tokens=16)
    assert sum(r.num_preemptions for r in reqs.values()) > 0
    assert any(victims), "no victim had a token in flight"
    assert all(len(o["tokens"]) == 10 for o in out.values())


def test_repetition_penalty_falls_back_to_sync_and_matches(llama_family):
    prompts = prompts_of([6, 14, 9], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=10, repetition_penalty=1.5,
                             logprobs=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=10, repetition_penalty=0.8),
              SamplingParams(temperature=0.0, max_tokens=10)]
    both(llama_family, [(f"r{i}", p, pa, n) for i, (p, pa, n) in
                        enumerate(zip(prompts, params, ["ap8", None, "rs4"]))])


# ---- (d) the steps really overlap ---------------------------------------------------
def launches_at_update(eng):
    """At each scheduler update: steps launched minus steps updated before it (1: only
    the step being updated was launched; 2: the next one was launched first)."""
    lead, update = [], eng.scheduler.update

    def spy(out, sampled):
        lead.append(eng.runner.num_launches - eng.scheduler.num_updates)
        return update(out, sampled)

    eng.scheduler.update = spy
    return lead


@pytest.mark.parametrize("mode", [False, True])
def test_async_launches_the_next_step_before_the_update(llama_family, mode):
    eng = make(llama_family, mode)
    lead = launches_at_update(eng)
    prompts = prompts_of([5, 9, 40, 3], seed=10)
    eng.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                 ["rs4", None, "ap8", None])
    assert len(lead) >= 12 and set(lead) <= {1, 2}
    if mode:  # all but the last update (nothing left to launch) overlap the next step
        assert lead.count(2) >= len(lead) - 1, lead
    else:
        assert set(lead) == {1}


def test_penalty_steps_do_not_overlap(llama_family):
    eng = make(llama_family, True)
    lead = launches_at_update(eng)
    eng.generate(prompts_of([5, 7], seed=11), SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2))
    assert lead.count(2) == 0, lead  # every step needed the previous token on the host


# ---- config --------------------------------------------------------------------------
def test_async_scheduling_config(llama_family):
    model = str(llama_family.model_dir)
    assert EngineConfig(model=model, device="cpu").use_async_scheduling is False
    assert EngineConfig(model=model, device="cuda").use_async_scheduling is True
    assert EngineConfig(model=model, device="cuda", tp_size=2).use_async_scheduling is True
    assert EngineConfig(model=model, device="cpu", tp_size=2).use_async_scheduling is False
    assert EngineConfig(model=model, device="cpu", async_scheduling=True).use_async_scheduling
    # asked for on the CPU at TP (tests/test_tp_async.py)
    assert EngineConfig(model=model, tp_size=2, async_scheduling=True).use_async_scheduling
    with pytest.raises(InvalidRequestError, match="async_scheduling='yes'"):
        EngineConfig(model=model, async_scheduling="yes")


def test_reusing_a_draining_request_id(llama_family):
    """An aborted request still held by the step in flight: its id can be reused at once
    (add_request completes that step first); nothing leaks."""
    eng = make(llama_family, True)
    prompt = prompts_of([6], seed=12)[0]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    eng.add_request("x", prompt, params)
    eng.step()
    eng.step()
    assert eng.abort("x") and eng.scheduler.is_draining("x")
    eng.add_request("x", prompt, params)
    assert not eng.scheduler.is_draining("x")
    again = eng.scheduler.get("x")
    (out,) = eng.generate([prompt], params)
    while eng.has_unfinished():
        eng.step()
    assert again.output_token_ids == out.token_ids and len(out.token_ids) == 6
    assert_idle(eng)
