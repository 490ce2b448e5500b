"""Greedy float32 parity with Hugging Face transformers + PEFT, token for token, logprobs
within 1e-4: base alone, one adapter, a mixed batch of adapters (ranks 4/8/32; rslora,
alpha_pattern, attention-only) and base requests with prompts from 1 token to longer than
the prefill chunk, on Llama (GQA) and Qwen2 (qkv bias); and batch invariance."""
import pytest
import torch

from loramux_engine import Engine, EngineConfig, FinishReason, SamplingParams

MAX_NEW = 8
CHUNK = 32  # max_num_batched_tokens: prompts longer than this are prefilled in chunks
LENGTHS = [1, 2, 5, 9, 16, 17, 33, 41, 70, 4, 23]
ADAPTERS = ["rs4", None, "ap8", "attn32", "rs4", None, "attn32", "ap8", "rs4", "ap8", None]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=True)


def prompts_of(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in lengths]


def make_engine(family, **kw):
    cfg = dict(model=str(family.model_dir), device="cpu", dtype="float32", max_loras=4,
               max_lora_rank=64, max_num_batched_tokens=CHUNK, block_size=8,
               num_kv_blocks=256)
    cfg.update(kw)
    eng = Engine(EngineConfig(**cfg))
    for name, path in family.adapters.items():
        eng.add_adapter(name, path)
    return eng


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request):
    family = request.getfixturevalue(f"{request.param}_family")
    oracle = request.getfixturevalue(f"{request.param}_oracle")
    return family, oracle, make_engine(family)


def assert_matches(outs, refs):
    for i, (out, (toks, lps)) in enumerate(zip(outs, refs)):
        assert out.token_ids == toks, f"request {i}: tokens differ"
        assert out.finish_reason == (FinishReason.EOS if len(toks) < MAX_NEW or
                                     toks[-1] == 1 else FinishReason.LENGTH)
        assert len(out.logprobs) == len(lps)
        diff = max(abs(a - b) for a, b in zip(out.logprobs, lps))
        assert diff < 1e-4, f"request {i}: logprob differs by {diff}"


def test_base_alone(setup):
    family, oracle, eng = setup
    prompts = prompts_of([12])
    assert_matches(eng.generate(prompts, GREEDY), oracle.generate(prompts, [None], MAX_NEW))


def test_one_adapter(setup):
    family, oracle, eng = setup
    prompts = prompts_of([40], seed=1)  # longer than one chunk
    outs = eng.generate(prompts, GREEDY, ["ap8"])
    assert_matches(outs, oracle.generate(prompts, ["ap8"], MAX_NEW))
    base = eng.generate(prompts, GREEDY)
    assert base[0].token_ids != outs[0].token_ids  # the adapter really changes the output


def test_mixed_batch(setup):
    family, oracle, eng = setup
    prompts = prompts_of(LENGTHS, seed=2)
    refs = oracle.generate(prompts, ADAPTERS, MAX_NEW)
    assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)


def test_mixed_batch_with_fewer_slots_than_adapters(llama_family, llama_oracle):
    """max_loras=2 < 3 adapters: requests are deferred and slots reused mid-run; outputs
    still equal the reference."""
    eng = make_engine(llama_family, max_loras=2)
    prompts = prompts_of(LENGTHS, seed=3)
    refs = llama_oracle.generate(prompts, ADAPTERS, MAX_NEW)
    assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
    stats = eng.stats()["adapters"]
    assert sum(a["evictions"] for a in stats.values()) >= 1


def test_batch_invariance(setup):
    family, oracle, eng = setup
    prompts = prompts_of(LENGTHS[:8], seed=4)
    names = ADAPTERS[:8]
    batched = eng.generate(prompts, GREEDY, names)
    for i in (0, 3, 6):
        alone = eng.generate([prompts[i]], GREEDY, [names[i]])[0]
        assert alone.token_ids == batched[i].token_ids
        assert max(abs(a - b) for a, b in zip(alone.logprobs, batched[i].logprobs)) < 1e-5
    reordered = eng.generate(prompts[::-1], GREEDY, names[::-1])[::-1]
    assert [o.token_ids for o in reordered] == [o.token_ids for o in batched]


def test_mixed_batch_with_norm_shrink_fused(llama_family, llama_oracle, monkeypatch):
    """engine/lora/batch.py FUSED_NORM_SHRINK and FUSED_SILU_SHRINK "all": every step's
    q/k/v and gate/up shrinks run inside the add + RMSNorm before them
    (kernels/lora/norm_shrink.py), down's inside the SiLU-and-multiply
    (kernels/lora/silu_shrink.py), under the Triton interpreter here, the expands after
    the matmuls; tokens equal the reference's and the engine's with the switches off."""
    from loramux_engine.lora import batch as batch_module
    from loramux_kernels import lora as lora_kernels
    from loramux_kernels.lora import launch
    lengths, adapters = [3, 9, 1, 14, 6], ["rs4", None, "ap8", "attn32", "rs4"]
    prompts = prompts_of(lengths, seed=5)
    off = make_engine(llama_family).generate(prompts, GREEDY, adapters)
    calls = {}

    def fused(name):                     # the Triton forms: the dispatcher says None off CUDA
        def run(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return getattr(launch, name)(*args, **kwargs)
        return run
    for name in ("norm_shrink_ahead", "silu_shrink_ahead"):
        monkeypatch.setattr(lora_kernels, name, fused(name))
    monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", "all")
    monkeypatch.setattr(batch_module, "FUSED_SILU_SHRINK", "all")
    on = make_engine(llama_family).generate(prompts, GREEDY, adapters)
    assert set(calls) == {"norm_shrink_ahead", "silu_shrink_ahead"}
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert_matches(on, llama_oracle.generate(prompts, adapters, MAX_NEW))
