"""Host -> slot copies ordered by events (engine/adapters/copier.py), checked with poisoned
slots: a copy is deferred as long as a real device could defer it, the slot holds NaN
meanwhile, and every launched step must read only slots whose copy has landed. More
adapters than slots, so slots are overwritten all the time; tokens must equal each
request run alone."""
import pytest
import torch

from loramux_engine.adapters.copier import InlineCopier, StreamCopier
from tests.support import fake_cuda
from tests.support.copies import PoisonedCopier
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import greedy, make_engine, run_to_end

NAMES = ["rs4", "ap8", "attn32"]
MAX_TOKENS = 5
LONG = 40  # tokens of the long request of run_mix(long_first=...)


@pytest.fixture(scope="module")
def references(llama_family):
    prompts = prompts_of([3, 6, 11, 4, 9, 7], seed=80)
    eng = make_engine(llama_family, NAMES, max_loras=1)
    refs = {}
    for name in NAMES:
        for i, p in enumerate(prompts):
            refs[name, i] = eng.generate([p], greedy(MAX_TOKENS), [name])[0].token_ids
    return prompts, refs


def poisoned_engine(family, lag: int, **kw):
    eng = make_engine(family, NAMES, max_loras=2, max_cpu_loras=3, **kw)
    copier = PoisonedCopier(eng.lora_pool, eng.scheduler.running_adapters, lag=lag)
    eng.adapters.copier = copier
    launch = eng.runner.launch

    def launch_clean(out, prev=None, greedy=None, masks=None):
        for s in out.scheduled:
            if s.slot >= 0:
                assert not copier.is_poisoned(s.slot), (
                    f"step reads slot {s.slot} (adapter {s.request.adapter_id}) before its "
                    "copy landed")
        pending = launch(out, prev, greedy, masks)
        copier.launched({s.slot for s in out.scheduled})
        return pending

    eng.runner.launch = launch_clean
    return eng, copier


def run_mix(eng, prompts, long_first: int = 0):
    """Requests round robin over more adapters than slots; returns {(name, i): tokens}.
    `long_first` > 0: the first request (of NAMES[0]) runs that many tokens and the others
    use the other adapters, so slots are swapped while its steps are in flight."""
    if long_first:
        order = [(NAMES[0], 0)] + [(NAMES[1 + i % 2], i) for i in range(1, len(prompts))]
    else:
        order = [(NAMES[i % len(NAMES)], i) for i in range(len(prompts))]
    for name, i in order:
        n = long_first if long_first and i == 0 else MAX_TOKENS
        eng.add_request(f"{name}-{i}", prompts[i], greedy(n), name)
    tokens, done = {}, set()
    for _ in range(400):
        if not eng.has_unfinished():
            break
        for o in eng.step():
            name, i = o.request_id.rsplit("-", 1)
            tokens.setdefault((name, int(i)), []).extend(o.new_token_ids)
            if o.finished:
                done.add((name, int(i)))
    else:
        raise AssertionError("no progress")
    assert done == set(tokens)
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("lag", [1, 3, 1000])
def test_no_step_reads_a_slot_before_its_copy(llama_family, references, async_scheduling, lag):
    """lag 1000: copies land only because a step is ordered after them."""
    prompts, refs = references
    eng, copier = poisoned_engine(llama_family, lag, async_scheduling=async_scheduling)
    got = run_mix(eng, prompts + prompts[::-1])
    n = len(prompts)
    for (name, i), toks in got.items():
        assert toks == refs[name, i if i < n else 2 * n - 1 - i], (name, i)
    assert len(got) == 2 * n
    assert sum(a["loads"] for a in eng.stats()["adapters"].values()) >= 3
    if lag == 1000:
        assert copier.num_forced > 0 and copier.num_background == 0
    assert copier.num_noted_overwrites > 0  # slots were reused after steps read them


def test_poison_is_caught_without_the_ordering(llama_family, references, monkeypatch):
    """The check above can fail: without order_before_step a step reads a poisoned slot."""
    prompts, _ = references
    eng, _ = poisoned_engine(llama_family, lag=1000)
    monkeypatch.setattr(eng.adapters, "order_before_step", lambda ids: None)
    with pytest.raises(AssertionError, match="before its copy landed"):
        run_mix(eng, prompts)


def test_unnoted_reads_are_caught(llama_family, references, monkeypatch):
    """The check above can fail: without note_step_reads a copy overwrites a slot that
    launched steps read, ordered after none of them."""
    prompts, _ = references
    eng, _ = poisoned_engine(llama_family, lag=1, async_scheduling=True)
    monkeypatch.setattr(eng.adapters, "note_step_reads", lambda slots: None)
    with pytest.raises(AssertionError, match="not ordered after launch"):
        run_mix(eng, prompts)


def test_overwriting_a_busy_slot_is_caught(llama_family, references):
    """The queue-time check can fail: a copy into a slot whose adapter is running."""
    prompts, _ = references
    eng, copier = poisoned_engine(llama_family, lag=1)
    eng.add_request("r", prompts[0], greedy(MAX_TOKENS), NAMES[0])
    eng.step()
    aid = eng.registry.resolve(NAMES[0])
    slot = eng.slots.slot_of(aid)
    with pytest.raises(AssertionError, match="overwritten while adapter"):
        copier.queue(slot, 99, lambda: None)


# The copier as the CPU engine uses it, and the CUDA copy pipeline modelled on recorded CPU
# streams (tests/support/fake_cuda.py): CPU engines whatever LORAMUX_TEST_DEVICE says (on a
# GPU, tests/test_cuda_adapter_copies.py runs the real streams).
cpu_engine = pytest.mark.engine_device("cpu")


@cpu_engine
def test_cpu_copies_are_inline(llama_family):
    eng = make_engine(llama_family, NAMES[:1])
    assert isinstance(eng.adapters.copier, InlineCopier)
    eng.generate([[5, 6, 7]], greedy(2), [NAMES[0]])
    assert not eng.adapters._copies


def stream_engine(family, monkeypatch, **kw):
    """An engine whose copies go through StreamCopier on recorded CPU streams
    (tests/support/fake_cuda.py); every launch and slot load is checked on the record:
    a copy into slot s is ordered after the last launched step that read s, and after no
    later step in flight that does not read it (the copy overlaps that step); a step
    that reads s is ordered after the last copy into s."""
    cuda = fake_cuda.install(monkeypatch)
    eng = make_engine(family, NAMES, max_loras=2, max_cpu_loras=3, async_scheduling=True,
                      **kw)
    copier = eng.adapters.copier = StreamCopier(torch.device("cpu"))
    side, compute = copier.stream, cuda.compute
    steps, copies = [], {}  # (position on compute, slots); slot -> position on side
    # copies queued while the step in flight did not / did read their slot
    overlapped = {False: 0, True: 0}
    launch, load = eng.runner.launch, eng.lora_pool.load

    def launch_ordered(out, prev=None, greedy=None, masks=None):
        assert cuda.current is compute
        slots = {s.slot for s in out.scheduled if s.slot >= 0}
        for slot in slots:
            assert slot not in copies or cuda.covered(compute, side, copies[slot]), (
                f"step reads slot {slot} before its copy")
        pending = launch(out, prev, greedy, masks)
        steps.append((compute.mark("step", slots), slots))
        return pending

    def load_ordered(slot, weights, stream=None):
        assert cuda.current is side, "slot load off the copier's stream"
        readers = [pos for pos, slots in steps if slot in slots]
        assert not readers or cuda.covered(side, compute, readers[-1]), (
            f"copy into slot {slot} not ordered after the step that read it")
        if eng._inflight is not None:
            reads = slot in steps[-1][1]
            assert reads or not cuda.covered(side, compute, steps[-1][0]), (
                f"copy into slot {slot} waits for the step in flight, which does not read it")
            overlapped[reads] += 1
        load(slot, weights, stream)
        copies[slot] = side.mark("copy", slot)

    eng.runner.launch, eng.lora_pool.load = launch_ordered, load_ordered
    return eng, cuda, copies, overlapped


@cpu_engine
@pytest.mark.parametrize("variant", [None, "waits for all compute", "host sync"])
def test_swaps_overlap_steps_without_host_syncs(llama_family, references, monkeypatch, variant):
    """Async scheduling with more adapters than slots: every swap goes through the
    StreamCopier on recorded streams. No host sync at all, tokens as each request alone.
    The variants show the checks can fail: a copier that waits for all queued compute (as
    a copy ordered by wait_stream would), and a step path that syncs on a pending copy."""
    prompts, refs = references
    eng, cuda, copies, overlapped = stream_engine(llama_family, monkeypatch)
    copier = eng.adapters.copier
    if variant == "waits for all compute":
        queue = copier.queue

        def queue_after_all(slot, adapter_id, copy):
            copier.stream.wait_stream(torch.cuda.current_stream())
            return queue(slot, adapter_id, copy)

        monkeypatch.setattr(copier, "queue", queue_after_all)
        with pytest.raises(AssertionError, match="waits for the step in flight"):
            run_mix(eng, prompts, long_first=LONG)
        return
    if variant == "host sync":
        order = eng.adapters.order_before_step

        def order_and_sync(adapter_ids):
            for aid in adapter_ids:
                if aid in eng.adapters._copies:
                    copier.wait(eng.adapters._copies[aid][0])
            order(adapter_ids)

        monkeypatch.setattr(eng.adapters, "order_before_step", order_and_sync)
    got = run_mix(eng, prompts, long_first=LONG)
    for (name, i), toks in got.items():
        assert toks[:MAX_TOKENS] == refs[name, i], (name, i)
    assert len(got) == len(prompts) and len(got[NAMES[0], 0]) == LONG and len(copies) == 2
    assert overlapped[False] > 0, "no copy was queued while a step that does not read it ran"
    loads = sum(a["loads"] for a in eng.stats()["adapters"].values())
    assert loads >= 3, loads
    if variant == "host sync":
        assert cuda.syncs, "the sync was not seen"
    else:
        assert cuda.syncs == [], f"host syncs on the step path: {cuda.syncs}"


@cpu_engine
@pytest.mark.parametrize("noted", [True, False])
def test_copy_into_a_slot_the_step_in_flight_reads(llama_family, references, monkeypatch,
                                                   noted):
    """A request preempted (KV blocks run out) while its step is in flight leaves its
    adapter without running requests: a waiting adapter may take that slot while the step
    still reads it. The copy then waits for that step on the device (its noted read), as
    the record shows; without the note it would not (`noted=False` is caught)."""
    prompts, refs = references
    eng, cuda, copies, overlapped = stream_engine(llama_family, monkeypatch, num_kv_blocks=7)
    preempted = []
    preempt = eng.scheduler._preempt
    monkeypatch.setattr(eng.scheduler, "_preempt", lambda req: preempted.append(req) or
                        preempt(req))
    if not noted:
        monkeypatch.setattr(eng.adapters, "note_step_reads", lambda slots: None)
    eng.add_request("y", prompts[4], greedy(30), NAMES[1])
    eng.add_request("x", prompts[2], greedy(30), NAMES[0])
    outs = eng.step() + eng.step()
    eng.add_request("z0", prompts[0], greedy(MAX_TOKENS), NAMES[2])
    eng.add_request("z1", prompts[3], greedy(MAX_TOKENS), NAMES[2])
    if not noted:
        with pytest.raises(AssertionError, match="not ordered after the step that read it"):
            run_to_end(eng)
        return
    tokens = {}
    for _ in range(300):
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        if not eng.has_unfinished():
            break
        outs = eng.step()
    assert preempted and overlapped[True] > 0, (preempted, overlapped)
    assert cuda.syncs == []
    for rid, (name, i) in {"y": (NAMES[1], 4), "x": (NAMES[0], 2), "z0": (NAMES[2], 0),
                           "z1": (NAMES[2], 3)}.items():
        assert tokens[rid][:MAX_TOKENS] == refs[name, i], rid
