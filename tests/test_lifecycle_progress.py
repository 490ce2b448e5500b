"""Progress across the three adapter tiers (device slots, host copies, disk) on the real
engine: the livelock scenarios of a cold adapter behind hot ones with one slot, and a host
tier ordered by use (an adapter serving requests keeps its host copy over an idle one)."""
import random
import time
from types import SimpleNamespace

import pytest
import torch

from loramux_engine.adapters.host_cache import PIN, HostCache
from loramux_engine.adapters.residency import AdapterResidency
from loramux_engine.adapters.slots import SlotTable
from loramux_core.errors import CapacityError
from tests.support.tiny import AdapterSpec, make_adapter
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import checked, greedy, make_engine


@pytest.fixture(scope="module")
def hot_dirs(llama_family, tmp_path_factory):
    """Six distinct adapters: the family's three and three more (random B)."""
    root = tmp_path_factory.mktemp("hot")
    extra = {f"h{i}": make_adapter(root / f"h{i}", llama_family.model_dir,
                                   AdapterSpec(r=4, lora_alpha=8, seed=90 + i))
             for i in range(3)}
    return {**llama_family.adapters, **extra}


def references(llama_family, dirs, prompt, n):
    eng = make_engine(llama_family, max_loras=1)
    refs = {}
    for name, path in dirs.items():
        eng.add_adapter(name, path)
        refs[name] = eng.generate([prompt], greedy(n), [name])[0].token_ids
    eng.close()
    return refs


def run_cold_behind_hot(eng, cold, hot, prompt, n, steps, every=1):
    """Request a hot adapter, then the cold one, then add a request for every hot adapter
    at every `every`-th step until the cold request finishes (at most `steps` steps); then drain.
    Returns {request id: (adapter name, Request)}."""
    reqs = {}

    def add(rid, name):
        eng.add_request(rid, prompt, greedy(n), name)
        reqs[rid] = (name, eng.scheduler.get(rid))

    add("hot-0", hot[0])
    eng.step()
    add("cold", cold)
    for t in range(steps):
        for name in hot if t % every == 0 else ():
            add(f"{name}-{t}", name)
        eng.step()
        if reqs["cold"][1].is_finished:
            break
    assert reqs["cold"][1].is_finished, "the cold adapter's request never ran"
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished(), "requests left waiting: no progress"
    return reqs


@pytest.mark.parametrize("hot_count,max_cpu_loras,every", [(1, 1, 1), (2, 1, 1), (4, None, 2)])
def test_cold_adapter_behind_hot_ones_finishes(llama_family, hot_dirs, hot_count,
                                               max_cpu_loras, every):
    """max_loras=1; the cold adapter's host copy is displaced by the hot ones (one host
    copy, or the default 4 with 4 hot adapters) and hot traffic never stops while the
    cold request waits: before the fix its disk read never started (every host copy was
    wanted by a paused hot adapter) and nothing ran again."""
    prompt = prompts_of([5], seed=95)[0]
    names = ["rs4"] + [n for n in hot_dirs if n != "rs4"][:hot_count]
    refs = references(llama_family, {n: hot_dirs[n] for n in names}, prompt, 3)
    eng = make_engine(llama_family, max_loras=1, max_cpu_loras=max_cpu_loras)
    batches = checked(eng)
    for name in names:  # the cold one first: loaded earliest, least recently used
        eng.add_adapter(name, hot_dirs[name])
    reqs = run_cold_behind_hot(eng, names[0], names[1:], prompt, 3, steps=40, every=every)
    for rid, (name, req) in reqs.items():
        assert req.output_token_ids == refs[name], rid
    assert max(len({s.request.adapter_id for s in b.scheduled}) for b in batches) == 1
    eng.close()


def test_adapter_in_use_keeps_its_host_copy_over_an_idle_one(llama_family, llama_oracle):
    eng = make_engine(llama_family, ["rs4", "ap8"], max_loras=2, max_cpu_loras=2)
    batches = checked(eng)
    ids = {a["name"]: aid for aid, a in eng.stats()["adapters"].items()}
    prompt = prompts_of([6], seed=96)[0]
    # rs4: loaded first, then in use; long enough to run through the cold read of ap8,
    # which is read off the step thread (in a loader process) while steps go on
    eng.add_request("busy", prompt, greedy(400), "rs4")
    for _ in range(3):
        eng.step()
    assert eng.stats()["adapters"][ids["rs4"]]["state"] == "slot"
    ids["attn32"] = eng.add_adapter("attn32", llama_family.adapters["attn32"])
    host = eng.adapters.host
    assert ids["rs4"] in host and ids["attn32"] in host  # the idle ap8 went
    assert eng.stats()["adapters"][ids["ap8"]]["host_evictions"] == 1
    eng.add_request("cold", prompt, greedy(2), "ap8")  # read back: displaces idle attn32
    busy, cold = eng.scheduler.get("busy"), eng.scheduler.get("cold")
    for _ in range(390):
        if cold.is_finished:
            break
        eng.step()
        assert ids["rs4"] in eng.adapters.host  # in use all along: never displaced
        time.sleep(0.005)  # paced: busy's 400 tokens leave the read two seconds at least
    assert cold.is_finished and not busy.is_finished
    assert ids["attn32"] not in eng.adapters.host
    while eng.has_unfinished():
        eng.step()
    want = llama_oracle.generate([prompt, prompt], ["rs4", "ap8"], 12)
    assert busy.output_token_ids[:12] == want[0][0] and cold.output_token_ids == want[1][0][:2]
    assert len(batches) >= 12


def test_host_claims_order_pinned_needed_in_use_idle():
    pinned = {1}
    h = HostCache(4, pinned)
    for aid in (1, 2, 3, 4):
        assert h.put(aid, f"w{aid}") == []
    h.set_claims(needed=[3], in_use={2})
    assert h.put(5, "w5") == [4]               # idle goes first
    assert h.put(6, "w6") == [5]               # an idle newcomer displaces an older idle
    h.set_claims(needed=[3], in_use={2, 6})
    assert h.put(7, "w7") is None and 7 not in h  # ... but no in-use or needed copy
    h.set_claims(needed=[8, 3], in_use={2, 6})
    assert h.put(8, "w8") == [2]               # the head's read displaces in-use copies
    h.set_claims(needed=[9, 8, 3], in_use={6})
    assert h.put(9, "w9") == [6]               # (they hold a slot), least recent first,
    h.set_claims(needed=[10, 9, 8, 3], in_use=set())
    assert h.put(10, "w10") == [3]             # then the lowest-priority needed one
    assert h.room_for(h.claim(11)) == 0 and h.room_for((PIN,)) == 3
    pinned.update({8, 9, 10})
    with pytest.raises(CapacityError, match="would need to evict a pinned one"):
        h.put(11, "w11", (PIN,))
    assert h.ids() == [1, 8, 9, 10]


@pytest.mark.parametrize("seed", range(4))
def test_read_rooms_are_room_for_of_each_needed_adapter_without_a_copy(seed):
    """The per-step table the residency reads instead of scanning every copy per read
    equals `room_for(claim(aid))` in every state: pinned copies and pins without one,
    needed copies ahead of and behind the newcomer, in-use and idle copies."""
    rng = random.Random(seed)
    for _ in range(200):
        capacity = rng.randint(1, 12)
        pinned: set[int] = set()
        h = HostCache(capacity, pinned)
        ids = range(1, 30)
        for aid in rng.sample(ids, rng.randint(0, 20)):
            h.put(aid, f"w{aid}")
        pinned.update(rng.sample(ids, rng.randint(0, 4)))
        needed = rng.sample(ids, rng.randint(0, 15))
        h.set_claims(needed, set(rng.sample(ids, rng.randint(0, 8))))
        for aid in rng.sample(ids, 5):
            h.touch(aid)  # an LRU order other than insertion's
        want = {aid: h.room_for(h.claim(aid)) for aid in needed if aid not in h}
        assert h.read_rooms() == want


class _Loader:
    """Reads that never land: what prefetch submits, and the pending count it reads."""

    def __init__(self):
        self.submitted: list[int] = []

    def is_pending(self, aid):
        return aid in self.submitted

    @property
    def num_pending(self):
        return len(self.submitted)

    def submit(self, aid, path, version):
        self.submitted.append(aid)


def _residency(host: HostCache, slots: SlotTable, loader: _Loader) -> AdapterResidency:
    record = SimpleNamespace(path="p", version="v", loads=0, evictions=0)
    registry = SimpleNamespace(get=lambda aid: record, find=lambda aid: record)
    return AdapterResidency(registry, slots, host, loader,
                            SimpleNamespace(load=lambda slot, weights: None), torch.device("cpu"))


def test_prefetch_starts_reads_only_where_the_host_tier_has_room():
    """R1: the head's read starts; another's only while copies it may displace outnumber
    the reads pending. Host tier of 4: a pinned copy (1), an idle one (3), and 2, needed
    ahead of 12 and 13. 10 (head) and 11 read (room 3 > 1 pending); 2 takes a slot; 12 and
    13 may displace only 3 and one free place (room 2, 2 pending): no read; the pinned 20
    may displace all but the pinned copy (room 3): it reads."""
    pins = {1, 20}
    host = HostCache(4, pins)
    for aid in (1, 2, 3):
        host.put(aid, f"w{aid}")
    loader = _Loader()
    residency = _residency(host, SlotTable(2, pins), loader)
    assert residency.prefetch([10, 11, 2, 12, 13, 20], busy=set())
    assert loader.submitted == [10, 11, 20]
    assert residency.state(2) == "slot" and residency.state(12) == "disk"


@pytest.mark.parametrize("capacity,reads", [(1, []), (2, [2])])
def test_prefetch_reads_for_an_adapter_it_evicted_by_its_own_claim(capacity, reads):
    """One slot, held by 2; 1 is wanted first and has a host copy, so it takes 2's slot
    (2 comes after it). 2, now without a slot or a copy, needed nothing when the claims
    were set: its read needs a place its idle claim may displace, which the needed copy
    of 1 is not (capacity 1: no read) and an older idle copy is (capacity 2: it reads)."""
    host, slots, loader = HostCache(capacity, set()), SlotTable(1), _Loader()
    for aid in (3, 1)[2 - capacity:]:
        host.put(aid, f"w{aid}")
    slots.assign(2, set())
    slots.mark_ready(2)
    assert _residency(host, slots, loader).prefetch([1, 2], busy=set())
    assert slots.resident() == {1: 0} and loader.submitted == reads
