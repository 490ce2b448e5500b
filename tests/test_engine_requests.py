"""Request-level behaviour of the engine: refusals (type and message, nothing disturbed),
finish reasons (stop strings, stop token ids, max_tokens), streaming deltas, seeded
sampling, and adapter versions (reload gives a new id, deferred removal)."""
import pytest

from loramux_engine import (AdapterError, AdapterNotFoundError, AdapterUnavailableError,
                    CapacityError, Engine, EngineConfig, FinishReason, InvalidRequestError,
                    PromptTooLongError, SamplingParams)
from tests.support.tiny import AdapterSpec, make_adapter
from tests.test_engine_parity import prompts_of


def greedy(n=8, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def eng(llama_family):
    eng = Engine(EngineConfig(model=str(llama_family.model_dir), max_loras=2, max_lora_rank=32,
                              max_num_batched_tokens=32, block_size=8, num_kv_blocks=64,
                              max_model_len=200))
    for name, path in llama_family.adapters.items():
        eng.add_adapter(name, path)
    return eng


def run_to_end(eng):
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


BAD_REQUESTS = [
    ("unknown adapter", dict(adapter="nope"), AdapterNotFoundError, "adapter 'nope' is not loaded"),
    ("empty prompt", dict(prompt=[]), InvalidRequestError, "prompt is empty"),
    ("empty text", dict(prompt=""), InvalidRequestError, "prompt is empty"),
    ("token out of vocab", dict(prompt=[5, 384]), InvalidRequestError,
     "prompt token 1: 384 is not a token id in [0, 384)"),
    ("negative token", dict(prompt=[-1]), InvalidRequestError, "prompt token 0: -1"),
    ("not a prompt", dict(prompt=3.5), InvalidRequestError, "prompt must be a string"),
    ("too long", dict(prompt=[5] * 190, params=greedy(11)), PromptTooLongError,
     "prompt has 190 tokens and max_tokens=11: 201 > max_model_len=200"),
    ("bad temperature", dict(params=SamplingParams(temperature=-1.0)), InvalidRequestError,
     "sampling.temperature=-1.0"),
    ("bad top_p", dict(params=SamplingParams(top_p=0.0)), InvalidRequestError, "sampling.top_p"),
    ("bad max_tokens", dict(params=SamplingParams(max_tokens=0)), InvalidRequestError,
     "sampling.max_tokens=0"),
    ("stop id out of vocab", dict(params=SamplingParams(stop_token_ids=[999])),
     InvalidRequestError, "sampling.stop_token_ids"),
    ("params not SamplingParams", dict(params={"max_tokens": 3}), InvalidRequestError,
     "must be a SamplingParams, got dict"),
    ("empty request id", dict(request_id=""), InvalidRequestError, "request_id=''"),
]


@pytest.mark.parametrize("what,kw,err,msg", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_is_refused_and_disturbs_nothing(eng, what, kw, err, msg):
    free = eng.kv.num_free_blocks
    args = dict(request_id="bad", prompt=[5, 6, 7], params=greedy(), adapter=None)
    args.update(kw)
    with pytest.raises(err) as exc:
        eng.add_request(**args)
    assert msg in str(exc.value)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == free
    assert all(a["in_flight"] == 0 for a in eng.stats()["adapters"].values())


def test_duplicate_request_id_refused(eng):
    eng.add_request("dup", [5, 6], greedy(2))
    with pytest.raises(InvalidRequestError, match="request_id='dup': already in use"):
        eng.add_request("dup", [7, 8], greedy(2), "rs4")
    run_to_end(eng)


def test_generate_refuses_all_when_one_is_bad(eng):
    with pytest.raises(AdapterNotFoundError, match="'missing'"):
        eng.generate([[5, 6], [7, 8]], greedy(2), ["rs4", "missing"])
    assert not eng.has_unfinished()
    with pytest.raises(InvalidRequestError, match="2 prompts need as many"):
        eng.generate([[5], [6]], [greedy()], None)


def test_max_tokens_and_stop_token_ids(eng):
    prompt = prompts_of([10], seed=20)[0]
    (full,) = eng.generate([prompt], greedy(8, ignore_eos=True), ["rs4"])
    assert full.finish_reason == FinishReason.LENGTH and len(full.token_ids) == 8
    stop_tok = full.token_ids[3]
    cut = full.token_ids.index(stop_tok) + 1
    (out,) = eng.generate([prompt], greedy(8, stop_token_ids=[stop_tok]), ["rs4"])
    assert out.finish_reason == FinishReason.STOP
    assert out.token_ids == full.token_ids[:cut]


def test_stop_string_and_streamed_text(eng):
    prompt = prompts_of([7], seed=21)[0]
    (full,) = eng.generate([prompt], greedy(12, ignore_eos=True), ["ap8"])
    assert full.text == eng.tokenizer.decode(full.token_ids)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    assert stop and stop in full.text
    eng.add_request("s", prompt, greedy(12, ignore_eos=True, stop=[stop]), "ap8")
    steps = run_to_end(eng)
    assert steps[-1].finished and steps[-1].finish_reason == FinishReason.STOP
    text = "".join(s.text_delta for s in steps)
    assert text == full.text[:full.text.index(stop)]
    tokens = [t for s in steps for t in s.new_token_ids]
    assert tokens == full.token_ids[:len(tokens)] and len(tokens) < 12


def test_seeded_sampling_same_alone_and_in_batch(eng):
    prompts = prompts_of([9, 15, 4, 33], seed=22)
    names = ["attn32", "rs4", None, "ap8"]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=8,
                            ignore_eos=True)
    (alone,) = eng.generate([prompts[0]], seeded, [names[0]])
    params = [seeded] + [SamplingParams(temperature=0.7, max_tokens=8, seed=i)
                         for i in range(3)]
    batch = eng.generate(prompts, params, names)
    assert batch[0].token_ids == alone.token_ids
    (other_seed,) = eng.generate([prompts[0]], SamplingParams(
        temperature=0.9, top_p=0.95, top_k=50, seed=99, max_tokens=8, ignore_eos=True),
        [names[0]])
    assert other_seed.token_ids != alone.token_ids


def test_reload_gives_new_id_and_remove_is_deferred(llama_family, llama_oracle, tmp_path):
    eng = Engine(EngineConfig(model=str(llama_family.model_dir), max_loras=2, max_lora_rank=32,
                              block_size=8, num_kv_blocks=64, max_num_batched_tokens=32))
    ads = llama_family.adapters
    old_id = eng.add_adapter("x", ads["rs4"])
    prompt = prompts_of([12], seed=23)[0]
    eng.add_request("old", prompt, greedy(8, ignore_eos=True), "x")
    eng.step()
    new_id = eng.add_adapter("x", ads["attn32"])  # reload the name with other weights
    assert new_id > old_id
    eng.add_request("new", prompt, greedy(8, ignore_eos=True), "x")
    eng.step()
    assert eng.remove_adapter("x") == new_id       # deferred: both versions in flight
    with pytest.raises(AdapterUnavailableError, match="'x' .* is being unloaded"):
        eng.add_request("late", prompt, greedy(), "x")
    old, new = eng.scheduler.get("old"), eng.scheduler.get("new")
    run_to_end(eng)
    refs = llama_oracle.generate([prompt, prompt], ["rs4", "attn32"], 8)
    assert old.output_token_ids == refs[0][0] and new.output_token_ids == refs[1][0]
    assert new.num_cached_tokens == 0  # same tokens, other id: nothing shared
    with pytest.raises(AdapterNotFoundError, match="adapter 'x' is not loaded"):
        eng.add_request("later", prompt, greedy(), "x")
    assert eng.stats()["adapters"] == {} and eng.slots.resident() == {}
    assert set(eng.kv.pool.cache.namespaces()) <= {0}
    with pytest.raises(AdapterNotFoundError):
        eng.remove_adapter("x")
    assert eng.add_adapter("x", ads["rs4"]) > new_id  # ids are never reused


def test_bad_adapter_refused_and_nothing_registered(eng, llama_family, tmp_path):
    biased = make_adapter(tmp_path / "lora_bias", llama_family.model_dir, AdapterSpec(r=4),
                          lora_bias=True)
    before = eng.stats()["adapters"]
    with pytest.raises(AdapterError, match="lora_bias") as exc:
        eng.add_adapter("biased", biased)
    assert exc.value.feature == "lora_bias"
    with pytest.raises(AdapterError):
        eng.add_adapter("missing", tmp_path / "does-not-exist")
    assert eng.stats()["adapters"] == before
    with pytest.raises(AdapterNotFoundError):
        eng.add_request("d", [5], greedy(), "biased")


def test_pinned_adapter_keeps_its_slot(llama_family):
    eng = Engine(EngineConfig(model=str(llama_family.model_dir), max_loras=2, max_lora_rank=32,
                              block_size=8, num_kv_blocks=64, max_num_batched_tokens=32))
    ads = llama_family.adapters
    pinned = eng.add_adapter("p", ads["rs4"], pinned=True)
    with pytest.raises(CapacityError, match="one must stay dynamic"):
        eng.add_adapter("q", ads["ap8"], pinned=True)
    eng.add_adapter("a", ads["ap8"])
    eng.add_adapter("b", ads["attn32"])
    prompt = prompts_of([5], seed=30)[0]
    eng.generate([prompt], greedy(2), ["p"])
    for name in ("a", "b", "a", "b"):  # only one dynamic slot: a and b take turns in it
        eng.generate([prompt], greedy(2), [name])
    stats = eng.stats()["adapters"]
    assert stats[pinned]["state"] == "slot" and stats[pinned]["evictions"] == 0
    assert stats[pinned]["loads"] == 1
    assert sum(s["evictions"] for s in stats.values()) == 3
    eng.set_adapter_pinned("p", False)
    eng.set_adapter_pinned("a", True)
    for name in ("a", "p"):  # p (least recently used, unpinned) goes; then b, not a
        eng.generate([prompt], greedy(2), [name])
    stats = eng.stats()["adapters"]
    assert stats[pinned]["evictions"] == 1 and not stats[pinned]["pinned"]
    assert {s["name"] for s in stats.values() if s["state"] == "slot"} == {"a", "p"}
    with pytest.raises(CapacityError):
        eng.set_adapter_pinned("b", True)
