"""Prefix cache namespaces, decode-time caching, preemption with resume, abort: through
the real engine on the tiny Llama, outputs checked against the HF + PEFT oracle."""
import pytest

from loramux_engine import Engine, EngineConfig, FinishReason, SamplingParams
from tests.test_engine_parity import prompts_of

BS = 8


def make_engine(family, **kw):
    cfg = dict(model=str(family.model_dir), max_loras=4, max_lora_rank=32,
               max_num_batched_tokens=32, block_size=BS, num_kv_blocks=128)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    for name, path in family.adapters.items():
        eng.add_adapter(name, path)
    return eng


def greedy(max_tokens=6, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=True, **kw)


@pytest.fixture(scope="module")
def eng(llama_family):
    return make_engine(llama_family)


def test_same_prompt_per_namespace_and_repeat_hits_cache(eng, llama_oracle):
    prompt = prompts_of([30], seed=10)[0]
    names = ["rs4", "attn32", None]
    refs = llama_oracle.generate([prompt] * 3, names, 6)
    outs = {}
    for name, (ref_toks, _) in zip(names, refs):
        (out,) = eng.generate([prompt], greedy(), [name])
        assert out.token_ids == ref_toks, name
        assert out.num_cached_tokens == 0, f"{name} matched another namespace's blocks"
        outs[name] = out
    hits_before = eng.stats()["adapters"][outs["rs4"].adapter_id]["cached_token_hits"]
    (again,) = eng.generate([prompt], greedy(), ["rs4"])
    assert again.num_cached_tokens == 24  # 3 full blocks of 8; the last token is computed
    assert again.token_ids == outs["rs4"].token_ids
    assert max(abs(a - b) for a, b in zip(again.logprobs, outs["rs4"].logprobs)) < 1e-5
    stats = eng.stats()["adapters"]
    assert stats[again.adapter_id]["cached_token_hits"] == hits_before + 24
    assert stats[outs["attn32"].adapter_id]["cached_token_hits"] == 0


def test_block_filled_during_decode_is_reused_in_its_namespace(eng, llama_oracle):
    prompt = prompts_of([6], seed=11)[0]
    (first,) = eng.generate([prompt], greedy(12, ignore_eos=True), ["ap8"])
    # K/V of prompt + 11 generated tokens were computed: blocks 0 and 1 are full, block 1
    # completed during decode
    follow = prompt + first.token_ids[:10] + [77]
    (out,) = eng.generate([follow], greedy(), ["ap8"])
    assert out.num_cached_tokens == 16
    assert out.token_ids == llama_oracle.generate([follow], ["ap8"], 6)[0][0]
    (other,) = eng.generate([follow], greedy(), ["rs4"])
    assert other.num_cached_tokens == 0


def test_preemption_all_finish_with_unconstrained_outputs(llama_family, llama_oracle):
    prompts = prompts_of([20, 27, 14, 35, 22, 18], seed=12)
    names = ["rs4", None, "ap8", "attn32", "rs4", None]
    params = greedy(10, ignore_eos=True)
    expected = [t for t, _ in llama_oracle.generate(prompts, names, 10)]
    # 6 requests need 4-6 blocks each (~28 blocks); the pool has 12
    eng = make_engine(llama_family, num_kv_blocks=12, max_num_batched_tokens=64)
    for i, (p, name) in enumerate(zip(prompts, names)):
        eng.add_request(f"r{i}", p, params, name)
    reqs = [eng.scheduler.get(f"r{i}") for i in range(6)]
    while eng.has_unfinished():
        eng.step()
    assert [r.output_token_ids for r in reqs] == [e[:10] for e in expected]
    assert all(r.finish_reason == FinishReason.LENGTH for r in reqs)
    preempted = [r for r in reqs if r.num_preemptions]
    assert preempted, "the pool was meant to be too small"
    assert any(r.num_resumed_cached_tokens > 0 for r in preempted)
    assert eng.kv.num_free_blocks == 12
    eng.kv.pool.check_invariants()


def test_abort_frees_everything(llama_family):
    eng = make_engine(llama_family, num_kv_blocks=40, max_num_seqs=3)
    start = eng.kv.num_free_blocks
    prompts = prompts_of([9, 30, 17, 5, 12], seed=13)
    names = ["rs4", "ap8", None, "attn32", "rs4"]
    for i, (p, name) in enumerate(zip(prompts, names)):
        eng.add_request(f"r{i}", p, greedy(20, ignore_eos=True), name)
    eng.step()
    eng.step()
    running = [r.request_id for r in eng.scheduler.running]
    waiting = [r.request_id for r in eng.scheduler.waiting]
    assert running and waiting
    assert eng.abort(waiting[0]) and eng.abort(running[0])
    assert not eng.abort(running[0]) and not eng.abort("nope")
    eng.step()
    for rid in list(r.request_id for r in [*eng.scheduler.running, *eng.scheduler.waiting]):
        assert eng.abort(rid)
    settle(eng)
    assert eng.kv.num_free_blocks == start
    assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
    assert all(a["in_flight"] == 0 for a in eng.stats()["adapters"].values())
    assert eng.scheduler.running_adapters() == set()
    eng.kv.pool.check_invariants()


def test_forks_share_prompt_blocks_and_inherit_adapter(llama_family, llama_oracle):
    eng = make_engine(llama_family)
    prompt = prompts_of([21], seed=14)[0]
    outs = eng.generate([prompt], greedy(6, n=3), ["attn32"])
    ref = llama_oracle.generate([prompt], ["attn32"], 6)[0][0]
    assert [o.request_id for o in outs] == [f"{outs[0].request_id[:-2]}/{i}" for i in range(3)]
    assert all(o.token_ids == ref for o in outs)  # greedy forks all follow the adapter
    assert len({o.adapter_id for o in outs}) == 1 and outs[0].adapter_id > 0
    assert [o.num_cached_tokens for o in outs] == [0, 16, 16]  # 2 full prompt blocks shared
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, n=3)
    forks = eng.generate([prompt], sampled, ["attn32"])
    assert len({tuple(o.token_ids) for o in forks}) > 1  # each fork draws its own noise
    again = eng.generate([prompts_of([5], seed=15)[0], prompt], [greedy(), sampled],
                         [None, "attn32"])[1:]
    assert [o.token_ids for o in again] == [o.token_ids for o in forks]


def settle(eng) -> None:
    """Aborted requests are finished at once; with async scheduling (on by default on
    CUDA) a step already launched may still hold them, and its completion frees them:
    one more step, which returns nothing for them."""
    for _ in range(2):
        if not eng.has_unfinished():
            return
        assert eng.step() == []
    assert not eng.has_unfinished()


def test_abort_of_forked_request_aborts_every_sequence(llama_family):
    eng = make_engine(llama_family)
    start = eng.kv.num_free_blocks
    eng.add_request("f", prompts_of([12], seed=16)[0], greedy(30, n=4, ignore_eos=True), "rs4")
    eng.step()
    assert len(eng.scheduler.running) == 4
    assert eng.abort("f")
    settle(eng)
    assert eng.kv.num_free_blocks == start and not eng._forks
    assert not eng.abort("f")


def test_prefix_caching_disabled_same_outputs(llama_family, eng):
    off = make_engine(llama_family, enable_prefix_caching=False)
    prompt = prompts_of([26], seed=17)[0]
    with_cache = [eng.generate([prompt], greedy(), ["ap8"])[0] for _ in range(2)]
    without = [off.generate([prompt], greedy(), ["ap8"])[0] for _ in range(2)]
    assert with_cache[1].num_cached_tokens == 24 and without[1].num_cached_tokens == 0
    assert {tuple(o.token_ids) for o in with_cache + without} == {tuple(with_cache[0].token_ids)}
