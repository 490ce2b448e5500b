"""Host -> slot copies ordered by events (engine/adapters/copier.py), checked with poisoned
slots: a copy is deferred as long as a real device could defer it, the slot holds NaN
meanwhile, and every launched step must read only slots whose copy has landed. More
adapters than slots, so slots are overwritten all the time; tokens must equal each
request run alone."""
import pytest

from engine.adapters.copier import InlineCopier
from tests.support.copies import PoisonedCopier
from tests.test_engine_parity import prompts_of
from tests.test_lifecycle_tiers import greedy, make_engine

NAMES = ["rs4", "ap8", "attn32"]
MAX_TOKENS = 5


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

    def launch_clean(out, prev=None, greedy=None):
        for s in out.scheduled:
            if s.slot >= 0:
                assert not copier.is_poisoned(s.slot), (
                    f"step reads slot {s.slot} (adapter {s.request.adapter_id}) before its "
                    "copy landed")
        return launch(out, prev, greedy)

    eng.runner.launch = launch_clean
    return eng, copier


def run_mix(eng, prompts):
    """Requests round robin over more adapters than slots; returns {(name, i): tokens}."""
    order = [(NAMES[i % len(NAMES)], i) for i in range(len(prompts))]
    for name, i in order:
        eng.add_request(f"{name}-{i}", prompts[i], greedy(MAX_TOKENS), name)
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


def test_poison_is_caught_without_the_ordering(llama_family, references, monkeypatch):
    """The check above can fail: without order_before_step a step reads a poisoned slot."""
    prompts, _ = references
    eng, _ = poisoned_engine(llama_family, lag=1000)
    monkeypatch.setattr(eng.adapters, "order_before_step", lambda ids: None)
    with pytest.raises(AssertionError, match="before its copy landed"):
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


def test_cpu_copies_are_inline(llama_family):
    eng = make_engine(llama_family, NAMES[:1])
    assert isinstance(eng.adapters.copier, InlineCopier)
    eng.generate([[5, 6, 7]], greedy(2), [NAMES[0]])
    assert not eng.adapters._copies
