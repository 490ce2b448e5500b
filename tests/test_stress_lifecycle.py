"""Seeded randomized stress: thousands of interleaved add/reload/unload/pin/unpin/request/
abort/step operations with fewer slots (2) and host copies (3) than adapters, checked
against a small model of the rules after every operation; at idle every reference count
is zero, every KV block free or cached, and every finished request's tokens equal the
reference for the adapter version (weights) it ran with. Run in sync and in async scheduling
(where a finished request still held by the step in flight keeps its adapter reference
until that step completes)."""
import random

import pytest

from engine import FinishReason
from engine.errors import AdapterNotFoundError, AdapterUnavailableError, CapacityError
from tests.support.tiny import AdapterSpec, make_adapter
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import checked, greedy, make_engine

MAX_TOKENS = 4
NAMES = ["a", "b", "c", "d", "e"]


@pytest.fixture(scope="module")
def weights_dirs(llama_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("stress")
    extra = {f"x{i}": make_adapter(root / f"x{i}", llama_family.model_dir,
                                   AdapterSpec(r=4 + 4 * i, lora_alpha=16, seed=70 + i))
             for i in range(2)}
    return {**llama_family.adapters, **extra}


@pytest.fixture(scope="module")
def references(llama_family, weights_dirs):
    """Tokens per (weights dir or None, prompt index), each run alone on its own engine."""
    prompts = prompts_of([3, 5, 9, 12], seed=60)
    eng = make_engine(llama_family, max_loras=1)
    refs = {}
    for key, path in [(None, None), *weights_dirs.items()]:
        if path is not None:
            eng.add_adapter(key, path)
        for i, p in enumerate(prompts):
            refs[key, i] = eng.generate([p], greedy(MAX_TOKENS), [key])[0].token_ids
    return prompts, refs


def check_step(eng, model, st):
    assert st["slots_used"] <= eng.config.max_loras
    assert st["host_copies"] <= eng.config.max_cpu_loras
    for aid in model["pinned"]:
        a = st["adapters"][aid]
        assert a["evictions"] == model["pin_evictions"][aid]  # never evicted while pinned
        assert a["host_evictions"] == model["pin_host_evictions"][aid]
    draining = [r.adapter_id for r in eng.scheduler.draining()]
    for aid, a in st["adapters"].items():
        assert a["in_flight"] == sum(1 for v in model["live"].values() if v[1] == aid) + \
            draining.count(aid)
    eng.kv.pool.check_invariants()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stress_lifecycle(llama_family, weights_dirs, references, async_scheduling):
    prompts, refs = references
    rng = random.Random(1234)
    eng = make_engine(llama_family, max_loras=2, max_cpu_loras=3, num_kv_blocks=24,
                      block_size=4, max_num_batched_tokens=16, max_num_seqs=6,
                      async_scheduling=async_scheduling)
    batches = checked(eng)
    keys = list(weights_dirs)
    version = {}     # adapter id -> weights key
    current = {}     # name -> (id, retiring)
    model = {"pinned": set(), "pin_evictions": {}, "pin_host_evictions": {}, "live": {}}
    tiers_seen = set()
    finished, counts, last_id = [], dict.fromkeys(
        ["add", "remove", "pin", "request", "abort", "step", "refused"], 0), 0

    def pin(aid, on):
        if on:
            st = eng.stats()["adapters"][aid]
            model["pinned"].add(aid)
            model["pin_evictions"][aid] = st["evictions"]
            model["pin_host_evictions"][aid] = st["host_evictions"]
        else:
            model["pinned"].discard(aid)

    for op_i in range(2000):
        op = rng.choices(["add", "remove", "pin", "request", "abort", "step"],
                         [4, 2, 3, 20, 3, 30])[0]
        name = rng.choice(NAMES)
        have = current.get(name)
        if op == "add":
            key, pinned = rng.choice(keys), rng.random() < 0.2
            others = model["pinned"] - ({have[0]} if have else set())
            if pinned and len(others) + 1 >= eng.config.max_loras:
                with pytest.raises(CapacityError, match="one must stay dynamic"):
                    eng.add_adapter(name, weights_dirs[key], pinned=True)
                counts["refused"] += 1
                continue
            aid = eng.add_adapter(name, weights_dirs[key], pinned=pinned)
            assert aid > last_id  # ids never reused
            last_id, version[aid] = aid, key
            if have:
                pin(have[0], False)
            current[name] = (aid, False)
            pin(aid, pinned)
        elif op == "remove":
            if have is None:
                with pytest.raises(AdapterNotFoundError):
                    eng.remove_adapter(name)
                counts["refused"] += 1
                continue
            assert eng.remove_adapter(name) == have[0]
            pin(have[0], False)
            current[name] = (have[0], True)
        elif op == "pin":
            on = rng.random() < 0.6
            if have is None or have[1]:
                with pytest.raises((AdapterNotFoundError, AdapterUnavailableError)):
                    eng.set_adapter_pinned(name, on)
                counts["refused"] += 1
                continue
            if on and have[0] not in model["pinned"] and \
                    len(model["pinned"]) + 1 >= eng.config.max_loras:
                with pytest.raises(CapacityError):
                    eng.set_adapter_pinned(name, True)
                counts["refused"] += 1
                continue
            eng.set_adapter_pinned(name, on)
            if on != (have[0] in model["pinned"]):
                pin(have[0], on)
        elif op == "request":
            use = None if rng.random() < 0.15 else name
            p = rng.randrange(len(prompts))
            rid = f"q{op_i}"
            if use is not None and (have is None or have[1]):
                err = AdapterNotFoundError if have is None else AdapterUnavailableError
                with pytest.raises(err):
                    eng.add_request(rid, prompts[p], greedy(MAX_TOKENS), use)
                counts["refused"] += 1
                continue
            eng.add_request(rid, prompts[p], greedy(MAX_TOKENS), use)
            aid = current[use][0] if use else 0
            model["live"][rid] = (p, aid, eng.scheduler.get(rid))
        elif op == "abort" and model["live"]:
            rid = rng.choice(sorted(model["live"]))
            assert eng.abort(rid)
            finished.append(model["live"].pop(rid))
        elif op == "step":
            for out in eng.step():
                if out.finished:
                    finished.append(model["live"].pop(out.request_id))
        counts[op] += 1
        # versions leave the model once retired and drained
        st = eng.stats()
        for n, (aid, retiring) in list(current.items()):
            if retiring and aid not in st["adapters"]:
                assert not any(v[1] == aid for v in model["live"].values())
                del current[n]
        check_step(eng, model, st)
        for a in st["adapters"].values():
            tiers_seen |= {k for k in ("evictions", "host_evictions", "disk_reads") if a[k]}

    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                finished.append(model["live"].pop(out.request_id))
    eng.step()  # idle: pending evictions flushed
    assert not model["live"]
    st = eng.stats()
    assert st["pending_evictions"] == 0 and st["free_kv_blocks"] == st["num_kv_blocks"]
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    assert all(a["in_flight"] == 0 and not a["unloading"] for a in st["adapters"].values())
    assert set(eng.kv.pool.cache.namespaces()) <= {0} | set(st["adapters"])
    assert eng.scheduler.running_adapters() == set()
    done = 0
    for p, aid, r in finished:
        ref = refs[version.get(aid), p]
        if r.finish_reason == FinishReason.ABORTED:
            assert r.output_token_ids == ref[:len(r.output_token_ids)]
        else:
            assert r.finish_reason == FinishReason.LENGTH and r.output_token_ids == ref
            done += 1
    assert done > 150 and counts["refused"] > 20 and counts["add"] > 30, (done, counts)
    assert tiers_seen >= {"evictions", "host_evictions", "disk_reads"}, tiers_seen
    assert len(batches) > 500 and eng.scheduler.draining() == []
