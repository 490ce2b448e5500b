"""Adapter tiers: device slots, host copies (LRU, pins), disk reads (implicit reload, files
changed on disk), prefetch that never makes a step wait, and the engine's stats. Real
engine on the tiny Llama; every executed batch is checked (see `checked`)."""
import random
import threading

import pytest

from loramux_engine import Engine, EngineConfig, FinishReason, SamplingParams
from loramux_engine.adapters.slots import SlotTable
from loramux_core.errors import AdapterNotFoundError, InvalidRequestError
from tests.test_engine_parity import prompts_of


def make_engine(family, adapters=None, **kw):
    cfg = dict(model=str(family.model_dir), max_loras=2, max_lora_rank=32, block_size=8,
               num_kv_blocks=64, max_num_batched_tokens=32)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    for name in adapters or ():
        eng.add_adapter(name, family.adapters[name])
    return eng


def checked(eng) -> list:
    """Check every batch the runner launches (sync or async scheduling): at most max_loras distinct adapters, and each
    adapter request reads a slot that its adapter owns and whose copy is complete (never
    the base model, never a half-copied slot). Returns the list of executed batches."""
    launch, batches = eng.runner.launch, []

    def launch_checked(out, prev=None, greedy=None, masks=None):  # every step launches here
        adapters = {s.request.adapter_id for s in out.scheduled} - {0}
        assert len(adapters) <= eng.config.max_loras
        for s in out.scheduled:
            aid = s.request.adapter_id
            assert s.slot == (eng.slots.ready_slot(aid) if aid else -1), (aid, s.slot)
            assert not aid or s.slot >= 0
        batches.append(out)
        return launch(out, prev, greedy, masks)

    eng.runner.launch = launch_checked
    return batches


def greedy(n=6):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def run_to_end(eng, limit=500):
    for _ in range(limit):
        if not eng.has_unfinished():
            return
        eng.step()
    raise AssertionError("engine made no progress")


def test_slot_table_never_evicts_protected_pinned_or_loading():
    t = SlotTable(3, pins={1})
    for aid in (1, 2, 3):
        assert t.assign(aid, set()).needs_load
    assert t.ready_slot(2) is None and t.slot_of(2) is not None  # loading: not readable
    t.mark_ready(1)
    t.mark_ready(2)
    assert t.assign(4, protected={2}) is None  # 1 pinned, 2 protected, 3 still loading
    t.mark_ready(3)
    assert t.assign(4, protected={2, 3}) is None
    a = t.assign(4, protected={3})
    assert a.evicted == 2 and t.slot_of(2) is None and t.ready_slot(4) is None


def test_slot_table_takes_the_lowest_free_slot_before_evicting():
    t = SlotTable(4)
    assert [t.assign(aid, set()).slot for aid in (1, 2, 3, 4)] == [0, 1, 2, 3]
    for aid in (1, 2, 3, 4):
        t.mark_ready(aid)
    assert t.release(3) == 2 and t.release(1) == 0 and t.release(9) is None
    a = t.assign(5, {2, 4})
    assert (a.slot, a.evicted) == (0, None) and t.can_assign(6, {2, 4, 5})
    assert t.assign(6, {2, 4, 5}).slot == 2
    t.mark_ready(5)
    t.mark_ready(6)
    assert not t.can_assign(7, {2, 4, 5, 6}) and t.assign(7, {2, 4, 5, 6}) is None
    a = t.assign(7, {4, 5, 6})  # none free: the least recently used unprotected one
    assert (a.slot, a.evicted) == (1, 2)
    assert t.resident() == {4: 3, 5: 0, 6: 2, 7: 1}


def test_slot_table_free_slots_follow_assignments_and_releases():
    """Random assigns, releases and touches: a new adapter always gets the lowest slot
    nobody holds, if any, and no two adapters ever share a slot."""
    rng = random.Random(3)
    t = SlotTable(6)
    for _ in range(2000):
        aid = rng.randrange(1, 12)
        op = rng.random()
        if op < 0.5:
            free = sorted(set(range(6)) - set(t.resident().values()))
            a = t.assign(aid, set())
            if a.needs_load:
                assert (a.slot, a.evicted) == (free[0], None) if free else a.evicted is not None
            t.mark_ready(aid)
        elif op < 0.8:
            slot = t.slot_of(aid)
            assert t.release(aid) == slot
        else:
            t.touch(aid)
        slots = list(t.resident().values())
        assert len(slots) == len(set(slots)) == t.num_used <= 6


def test_host_capacity_below_slots_refused(llama_family):
    with pytest.raises(InvalidRequestError, match="max_cpu_loras=1: must be >= max_loras=2"):
        make_engine(llama_family, max_cpu_loras=1)


def test_host_lru_eviction_and_implicit_reload_from_disk(llama_family, llama_oracle):
    eng = make_engine(llama_family, ["rs4", "ap8", "attn32"], max_cpu_loras=2)
    checked(eng)
    st = eng.stats()["adapters"]
    by_name = {a["name"]: a for a in st.values()}
    assert by_name["rs4"]["state"] == "disk" and by_name["rs4"]["host_evictions"] == 1
    assert {by_name[n]["state"] for n in ("ap8", "attn32")} == {"host"}
    prompt = prompts_of([7], seed=40)[0]
    (out,) = eng.generate([prompt], greedy(), ["rs4"])  # read back from disk, then a slot
    assert out.token_ids == llama_oracle.generate([prompt], ["rs4"], 6)[0][0]
    rec = eng.stats()["adapters"][out.adapter_id]
    assert rec["disk_reads"] == 1 and rec["state"] == "slot" and rec["loads"] == 1
    assert eng.stats()["host_copies"] == 2


def test_pinned_adapter_stays_in_host_memory(llama_family):
    eng = make_engine(llama_family, max_cpu_loras=2)
    pinned = eng.add_adapter("p", llama_family.adapters["rs4"], pinned=True)
    for name in ("ap8", "attn32", "ap8"):
        eng.add_adapter(name, llama_family.adapters[name])
    st = eng.stats()["adapters"]
    assert st[pinned]["state"] in ("host", "slot") and st[pinned]["host_evictions"] == 0
    eng.step()  # an idle step brings the pinned adapter into a slot
    assert eng.stats()["adapters"][pinned]["state"] == "slot"


def test_unloaded_adapter_is_unknown_evicted_one_reloads(llama_family):
    eng = make_engine(llama_family, ["rs4", "ap8", "attn32"], max_loras=1, max_cpu_loras=1)
    prompt = prompts_of([5], seed=41)[0]
    for name in ("rs4", "ap8", "attn32", "rs4"):  # every switch evicts slot and host copy
        eng.generate([prompt], greedy(2), [name])
    assert sum(a["evictions"] for a in eng.stats()["adapters"].values()) == 3
    eng.remove_adapter("ap8")
    with pytest.raises(AdapterNotFoundError, match="adapter 'ap8' is not loaded"):
        eng.add_request("x", prompt, greedy(), "ap8")
    assert {a["name"] for a in eng.stats()["adapters"].values()} == {"rs4", "attn32"}


def test_files_changed_on_disk_fail_that_version_only(llama_family, tmp_path):
    import shutil
    src = tmp_path / "copy"
    shutil.copytree(llama_family.adapters["rs4"], src)
    eng = make_engine(llama_family, ["ap8"], max_loras=1, max_cpu_loras=1)
    aid = eng.add_adapter("c", src)  # evicts ap8's host copy; then c's goes for ap8
    eng.generate([[5, 6, 7]], greedy(2), ["ap8"])
    assert eng.stats()["adapters"][aid]["state"] == "disk"
    (src / "adapter_model.safetensors").write_bytes(
        (src / "adapter_model.safetensors").read_bytes() + b" ")
    eng.add_request("r", [5, 6, 7], greedy(2), "c")
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == \
        [("r", True, FinishReason.ERROR)]
    assert aid not in eng.stats()["adapters"]
    eng.generate([[5, 6, 7]], greedy(2), ["ap8"])  # the other adapter is undisturbed


def test_prefetch_never_makes_a_step_wait(llama_family, llama_oracle):
    eng = make_engine(llama_family, ["rs4", "ap8", "attn32"], max_cpu_loras=2)
    batches = checked(eng)
    gate = threading.Event()
    read = eng.adapters.loader._load_weights
    eng.adapters.loader._load_weights = lambda path, version: (gate.wait(30), read(path, version))[1]
    prompt = prompts_of([6], seed=42)[0]
    eng.add_request("base", prompt, greedy(10), None)
    eng.step()
    eng.add_request("lora", prompt, greedy(), "rs4")  # rs4 is on disk; its read is held
    for _ in range(4):
        outs = eng.step()
        assert [o.request_id for o in outs] == ["base"]  # base advances, lora waits
    assert eng.scheduler.get("lora").num_computed_tokens == 0
    gate.set()
    lora = eng.scheduler.get("lora")
    run_to_end(eng)
    assert lora.output_token_ids == llama_oracle.generate([prompt], ["rs4"], 6)[0][0]
    assert all(len(b.scheduled) for b in batches)


def test_stats_report_tiers_and_engine_counters(llama_family):
    eng = make_engine(llama_family, ["rs4", "ap8"])
    prompt = prompts_of([9], seed=43)[0]
    eng.generate([prompt], greedy(2), ["rs4"])
    (again,) = eng.generate([prompt], greedy(2), ["rs4"])
    st = eng.stats()
    a = st["adapters"][again.adapter_id]
    assert (a["state"], a["in_flight"], a["loads"], a["evictions"]) == ("slot", 0, 1, 0)
    assert a["cached_token_hits"] == 8
    assert st["slots_used"] == 1 and st["pending_evictions"] == 0
    assert st["free_kv_blocks"] == st["num_kv_blocks"] == 64
    eng.add_request("r", prompt, greedy(4), "ap8")
    eng.step()
    eng.remove_adapter("ap8")
    st = eng.stats()
    assert st["pending_evictions"] == 1 and st["slots_used"] == 2
    assert st["free_kv_blocks"] < 64
    ap8 = [x for x in st["adapters"].values() if x["name"] == "ap8"][0]
    assert ap8["unloading"] and ap8["in_flight"] == 1
