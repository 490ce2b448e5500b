"""One engine over two tensor-parallel ranks (gloo on the CPU) against the same engine on one
rank: token for token in float32, on the Llama and Qwen2 test models, for a mixed batch of
adapters of different ranks and base requests with chunked prefill, slot eviction and
preemption; and the adapter lifecycle (load, pin, unload under traffic, reload with new
weights, implicit reload into a slot, host copies evicted and read back from disk) giving
the same results as at TP=1.

One TP=1 and one TP=2 engine per model for the whole module (worker start-up is the
expensive part). The disk round trip of host copies builds engines of its own, so it is
in tests/test_tp_host_copies.py: on CUDA a process holds one TP engine at a time, and this
module's engines live until its end."""
from __future__ import annotations

import pytest

from loramux_engine import (AdapterError, AdapterUnavailableError, Engine, EngineConfig,
                            SamplingParams)

# 2 slots for 3 adapters: slots are evicted and reloaded; 20 blocks of 4: preemption
CFG = dict(max_loras=2, max_lora_rank=32, block_size=4, num_kv_blocks=20,
           max_num_batched_tokens=16, max_num_seqs=8)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)
PROMPTS = [[3 + (7 * i + 5 * j) % 300 for j in range(n)] for i, n in
           enumerate((5, 23, 9, 31, 14, 6, 27))]
MIXED = ["rs4", None, "ap8", "attn32", "rs4", None, "ap8"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request):
    family = request.getfixturevalue(f"{request.param}_family")
    engines = {}
    try:
        for tp in (1, 2):
            engines[tp] = Engine(EngineConfig(model=str(family.model_dir), tp_size=tp, **CFG))
            for name, path in family.adapters.items():
                engines[tp].add_adapter(name, path)
        yield family, engines[1], engines[2]
    finally:
        for e in engines.values():
            e.close()


def run_all(engine: Engine, reqs: list[tuple[str, list[int], str | None]]) -> dict:
    """Queue every request, step to the end; tokens and logprobs per id, and whether any
    request was preempted on the way."""
    for rid, prompt, adapter in reqs:
        engine.add_request(rid, prompt, GREEDY, adapter)
    got = {rid: ([], []) for rid, _, _ in reqs}
    preempted = False
    while engine.has_unfinished():
        preempted |= any(r.num_preemptions for r in engine.scheduler.running)
        preempted |= any(r.num_preemptions for r in engine.scheduler.waiting)
        for out in engine.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].extend(out.new_logprobs)
    return {"outputs": got, "preempted": preempted}


def assert_same(one: dict, two: dict) -> None:
    assert one.keys() == two.keys()
    for rid in one:
        assert two[rid][0] == one[rid][0], rid
        assert two[rid][1] == pytest.approx(one[rid][1], abs=1e-4), rid


def test_mixed_batch_matches_tp1(pair):
    family, tp1, tp2 = pair
    reqs = [(f"mixed-{i}", p, a) for i, (p, a) in enumerate(zip(PROMPTS, MIXED))]
    one, two = run_all(tp1, reqs), run_all(tp2, reqs)
    assert one["preempted"] and two["preempted"], "the KV pool was meant to force preemption"
    assert_same(one["outputs"], two["outputs"])
    assert all(len(t) == GREEDY.max_tokens for t, _ in two["outputs"].values())
    # adapters change the tokens (otherwise the comparison would prove little)
    plain = run_all(tp1, [("plain", PROMPTS[0], None)])["outputs"]["plain"][0]
    assert plain != one["outputs"]["mixed-0"][0]
    # a second wave brings evicted adapters back into slots (implicit reload)
    wave = [(f"wave-{i}", PROMPTS[6 - i], a) for i, a in enumerate(["rs4", "attn32", "ap8", "rs4"])]
    assert_same(run_all(tp1, wave)["outputs"], run_all(tp2, wave)["outputs"])
    s1, s2 = tp1.stats()["adapters"], tp2.stats()["adapters"]
    assert {k: v["loads"] for k, v in s1.items()} == {k: v["loads"] for k, v in s2.items()}
    assert max(v["loads"] for v in s2.values()) >= 2, "no adapter was reloaded into a slot"


def lifecycle(engine: Engine, family) -> dict:
    """Load, pin, unload under traffic, reload with other weights, load again."""
    a = family.adapters
    seen = {}
    engine.add_adapter("x", a["rs4"])
    engine.add_adapter("y", a["ap8"])
    engine.set_adapter_pinned("y", True)
    for rid, p, name in (("x1", PROMPTS[1], "x"), ("b1", PROMPTS[2], None), ("y1", PROMPTS[3], "y")):
        engine.add_request(rid, p, GREEDY, name)
    outs = {rid: [] for rid in ("x1", "b1", "y1", "y2", "x2")}
    for _ in range(4):
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    engine.remove_adapter("x")               # x1 still decoding: unload deferred
    with pytest.raises(AdapterUnavailableError):
        engine.add_request("refused", PROMPTS[0], GREEDY, "x")
    engine.set_adapter_pinned("y", False)
    engine.add_adapter("y", a["attn32"])     # new weights while y1 runs on the old ones
    engine.add_request("y2", PROMPTS[3], GREEDY, "y")
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    engine.add_adapter("x", a["ap8"])        # the unloaded name, back with other weights
    engine.add_request("x2", PROMPTS[1], GREEDY, "x")
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    seen["names"] = sorted(r["name"] for r in engine.stats()["adapters"].values())
    for name in ("x", "y"):
        engine.remove_adapter(name)
    engine.step()  # nothing in flight: frees now
    seen["after"] = sorted(r["name"] for r in engine.stats()["adapters"].values())
    return {"outputs": outs, **seen}


def test_adapter_lifecycle_matches_tp1(pair):
    family, tp1, tp2 = pair
    one, two = lifecycle(tp1, family), lifecycle(tp2, family)
    assert two == one
    out = one["outputs"]
    assert out["y1"] != out["y2"], "reloading y with other weights must change its tokens"
    assert out["x1"] != out["x2"]
    assert "x" not in one["after"] and "y" not in one["after"]


def test_bad_adapter_is_refused_and_engine_goes_on(pair, tmp_path):
    family, tp1, tp2 = pair
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError):
        tp2.add_adapter("broken", tmp_path)
    reqs = [("after-bad", PROMPTS[4], "attn32")]
    assert_same(run_all(tp1, reqs)["outputs"], run_all(tp2, reqs)["outputs"])


def test_a_lazily_registered_adapter_matches_tp1(pair):
    """Registered from its checks alone (as loads past a full host tier are), read at its
    first request by rank 0 and, under its fingerprint version, by the worker: the tokens
    of the same files loaded at once, at TP=1 and TP=2."""
    family, tp1, tp2 = pair
    outs = {}
    for tp, engine in ((1, tp1), (2, tp2)):
        read = engine.read_adapter("lazy-ap8", family.adapters["ap8"], lazy=True)
        assert read.weights is None and read.version.startswith("stat-")
        engine.register_adapter(read)
        try:
            outs[tp] = run_all(engine, [("lazy", PROMPTS[1], "lazy-ap8"),
                                        ("eager", PROMPTS[1], "ap8")])["outputs"]
        finally:
            engine.remove_adapter("lazy-ap8")
    assert_same(outs[1], outs[2])
    assert_same({"r": outs[2]["lazy"]}, {"r": outs[2]["eager"]})
