"""Constrained requests through the engine's hard cases (tiny Llama on the CPU): the
matcher survives preemption and recompute, a resumed stream replays its tokens into a
fresh matcher, refused constraints and compiles past their bound end their request alone,
a compile that cannot run stalls no other request, and steps with constrained rows never
take the greedy pick (which has no mask)."""
import json
import re
import threading

import pytest

from loramux_core.errors import InvalidRequestError
from loramux_core.structured import StructuredOutput
from loramux_engine.request import Request
from loramux_engine.scheduler import ScheduledRequest
from tests.test_engine_parity import GREEDY, make_engine, prompts_of
from tests.test_engine_structured import CONSTRAINTS, check, drive, params


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def async_mode(request):
    return request.param


@pytest.fixture(scope="module")
def engine(llama_family, async_mode):
    eng = make_engine(llama_family, async_scheduling=async_mode)
    yield eng
    eng.close()


def test_preemption_keeps_the_matcher(llama_family, engine, async_mode):
    short = CONSTRAINTS[1:4]   # regex, choice, grammar: short documents
    prompts = prompts_of([10, 12, 9, 11, 8, 12], seed=5)
    reqs = [(f"p{i}", pr, params(short[i % 3], sampled=i % 2 == 1, max_tokens=30),
             [None, "rs4", "ap8"][i % 3]) for i, pr in enumerate(prompts)]
    roomy = drive(engine, reqs)
    # 48 token slots for six requests of up to 42 tokens: preemption whatever the order
    tight = make_engine(llama_family, async_scheduling=async_mode, block_size=4,
                        num_kv_blocks=12, max_num_batched_tokens=16)
    try:
        for s in short:  # compiled first: no request waits for a compile thread, so the
            tight.grammars.compiler.submit(s).result()   # requests contend for blocks
        out = drive(tight, reqs)
    finally:
        tight.close()
    assert sum(o["req"].num_preemptions for o in out.values()) > 0
    for (rid, _, p, _) in reqs:
        check(p.structured, out[rid]["text"])
        assert out[rid]["tokens"] == roomy[rid]["tokens"]


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_resumed_stream_continues_under_its_constraint(engine, sampled):
    s = CONSTRAINTS[0]
    prompt = prompts_of([7], seed=6)[0]
    p = params(s, sampled)
    whole = drive(engine, [("w", prompt, p, "attn32")])["w"]["tokens"]
    k = len(whole) // 2
    rest = drive(engine, [("r", prompt, p, "attn32")], generated={"r": whole[:k]})["r"]
    assert whole[:k] + rest["tokens"] == whole
    check(s, engine.tokenizer.decode(whole))


def test_resumed_tokens_the_constraint_refuses(engine):
    bad = engine.tokenizer.encode("zzz", add_special_tokens=False)
    out = drive(engine, [("b", [5, 6, 7], params(CONSTRAINTS[2]), None),
                         ("f", [5, 6, 7], GREEDY, None)], generated={"b": bad})
    assert isinstance(out["b"]["error"], InvalidRequestError)
    assert "generated_token_ids" in str(out["b"]["error"]) and out["b"]["reason"] == "error"
    assert out["f"]["error"] is None and len(out["f"]["tokens"]) == GREEDY.max_tokens


@pytest.mark.parametrize("kind,spec", [
    ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})),
    ("regex", "(a|b"),
    ("grammar", "start: undefined_rule"),
])
def test_refused_constraint_ends_only_its_request(engine, kind, spec):
    prompts = prompts_of([6, 8, 5], seed=7)
    alone = drive(engine, [("f", prompts[1], GREEDY, "rs4")])["f"]["tokens"]
    out = drive(engine, [("bad", prompts[0], params(StructuredOutput(kind, spec)), None),
                         ("f", prompts[1], GREEDY, "rs4"),
                         ("good", prompts[2], params(CONSTRAINTS[1]), "ap8")])
    err = out["bad"]["error"]
    assert isinstance(err, InvalidRequestError) and out["bad"]["tokens"] == []
    assert str(err).startswith(f"sampling.structured.{kind}: ")
    assert out["f"]["tokens"] == alone
    check(CONSTRAINTS[1], out["good"]["text"])


class BlockedCompiles:
    """Every compile thread of the engine busy until released: a compile as slow as
    one likes, without timing anything."""

    def __init__(self, engine):
        self.gate = threading.Event()
        pool = engine.grammars.compiler.pool
        self.blockers = [pool.submit(self.gate.wait)
                         for _ in range(engine.grammars.compiler.cfg.threads)]

    def release(self):
        self.gate.set()
        for b in self.blockers:
            b.result()


def test_a_waiting_compile_stalls_no_one(engine):
    regex = "(xy|z){2,4}"   # not compiled before: not cached
    blocked = BlockedCompiles(engine)
    try:
        engine.add_request("slow", [4, 5, 6], params(StructuredOutput("regex", regex)))
        engine.add_request("f0", [7, 8], GREEDY)
        engine.add_request("f1", [9, 10, 11], GREEDY, "ap8")
        done = set()
        for _ in range(200):
            done |= {o.request_id for o in engine.step() if o.finished}
            if {"f0", "f1"} <= done:
                break
        assert {"f0", "f1"} <= done and "slow" not in done
        slow = engine.scheduler.get("slow")
        assert not slow.grammar.ready and slow.num_output_tokens == 0
    finally:
        blocked.release()
    text = ""
    while engine.has_unfinished():
        text += "".join(o.text_delta for o in engine.step())
    assert slow.finish_reason == "stop" and re.fullmatch(regex, text)


def test_a_compile_past_its_bound_ends_only_its_request(engine):
    regex = "q{3}r"
    s = StructuredOutput("regex", regex)
    blocked = BlockedCompiles(engine)
    engine.grammars.timeout_s = 0.0
    try:
        out = drive(engine, [("late", [4, 5], params(s), None), ("f", [6, 7], GREEDY, None)])
    finally:
        engine.grammars.timeout_s = 10.0
        blocked.release()
    err = out["late"]["error"]
    assert isinstance(err, InvalidRequestError) and "not compiled within" in str(err)
    assert str(err).startswith("sampling.structured.regex: ")
    assert len(out["f"]["tokens"]) == GREEDY.max_tokens
    again = drive(engine, [("again", [4, 5], params(s), None)])["again"]
    assert again["error"] is None and re.fullmatch(regex, again["text"])


def test_constrained_steps_skip_the_greedy_pick(engine):
    free = Request("a", [1, 2], GREEDY)
    tied = Request("b", [1, 2], params(CONSTRAINTS[2]))
    sched = [ScheduledRequest(r, 0, 2, (0,), -1, True) for r in (free, tied)]
    assert engine.runner.takes_greedy_pick(sched[:1], tensor_parallel=True)
    assert not engine.runner.takes_greedy_pick(sched, tensor_parallel=True)
