"""CUDA graphs for decode on a real GPU (skipped without one): graph replays give the
eager engine's tokens and logprobs (and HF + PEFT's tokens) for mixed adapter/base
batches, and an adapter loaded into a slot after capture is served by the same graphs;
DoRA and LoRA on lm_head / embed_tokens in the graphs keyed by them; the greedy
graphs' Triton pick (GREEDY_PICK "triton") against their torch pick; one adapter inside
the base GEMMs (FUSED_LORA_GEMM) across adapters taking turns in one slot."""
import pytest
import torch

from loramux_engine import Engine, EngineConfig, SamplingParams
from tests.support.kernel_path import count_fused_shrinks
from tests.test_kernel_path_extras import engine_family  # noqa: F401 (fixture)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MAX_NEW = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=True)


def prompts_of(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=gen).tolist() for n in lengths]


def engine(family, eager, adapters, max_loras=3):
    eng = Engine(EngineConfig(model=str(family.model_dir), device="cuda", dtype="float32",
                              max_loras=max_loras, max_lora_rank=64, max_num_seqs=8,
                              block_size=8,
                              num_kv_blocks=128, max_model_len=256, enforce_eager=eager))
    for name in adapters:
        eng.add_adapter(name, family.adapters[name])
    return eng


def count_fused(monkeypatch, setting: str) -> list[int]:
    """FUSED_NORM_SHRINK and FUSED_SILU_SHRINK = setting; the launches of the fused
    norm + shrink and SiLU + shrink (loramux_kernels.lora's non-None results), counted."""
    from loramux_engine.lora import batch as batch_module
    from loramux_kernels import lora as lora_kernels
    monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", setting)
    monkeypatch.setattr(batch_module, "FUSED_SILU_SHRINK", setting)
    return count_fused_shrinks(monkeypatch, lora_kernels)


def assert_same(got, want):
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.token_ids == w.token_ids, f"request {i}: tokens differ"
        diff = max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs))
        assert diff < 1e-4, f"request {i}: logprob differs by {diff}"


@pytest.mark.parametrize("norm_shrink", ["off", "all"])
def test_graph_replay_matches_eager_and_hf(llama_family, llama_oracle, norm_shrink,
                                           monkeypatch):
    """norm_shrink: engine/lora/batch.py FUSED_NORM_SHRINK and FUSED_SILU_SHRINK (graphs
    and eager steps)."""
    fused = count_fused(monkeypatch, norm_shrink)
    names = ["rs4", "ap8", "attn32"]
    graphs, eager = engine(llama_family, False, names), engine(llama_family, True, names)
    assert graphs.runner.graphs is not None and eager.runner.graphs is None
    prompts = prompts_of([5, 17, 1, 9, 30], seed=0)
    adapters = ["rs4", None, "attn32", "ap8", None]
    got = graphs.generate(prompts, GREEDY, adapters)
    assert_same(got, eager.generate(prompts, GREEDY, adapters))
    for g, (toks, _) in zip(got, llama_oracle.generate(prompts, adapters, MAX_NEW)):
        assert g.token_ids == toks
    assert graphs.runner.graphs.num_replays >= MAX_NEW - 1
    assert (8, True) in graphs.runner.graphs.captured   # 5 rows -> bucket 8, with LoRA
    base = prompts_of([4, 11], seed=1)
    assert_same(graphs.generate(base, GREEDY), eager.generate(base, GREEDY))
    assert (2, False) in graphs.runner.graphs.captured  # base-only batch: no LoRA launches
    assert (fused[0] > 0) == (norm_shrink != "off")


@pytest.mark.parametrize("norm_shrink,lora_gemm", [("off", "off"), ("uniform", "off"),
                                                   ("off", "rows"), ("off", "all")])
def test_one_adapter_batch_uniform_graph_matches_eager_and_hf(llama_family, llama_oracle,
                                                             norm_shrink, lora_gemm,
                                                             monkeypatch):
    """Every row on one adapter: the uniform graph (two LoRA launches per group with the
    launch parameters tuned for one adapter; with `norm_shrink` "uniform" the q/k/v and
    gate/up shrinks inside the norms before them, down's inside the activation; with
    `lora_gemm`, engine/lora/batch.py FUSED_LORA_GEMM, the LoRA inside the base GEMMs, in
    the eager engine's one-adapter steps too), with a padding row (no adapter) in its
    bucket: 3 rows -> bucket 4."""
    from loramux_engine.lora import batch as batch_module
    monkeypatch.setattr(batch_module, "FUSED_LORA_GEMM", lora_gemm)
    fused = count_fused(monkeypatch, norm_shrink)
    names = ["rs4", "ap8"]
    graphs, eager = engine(llama_family, False, names), engine(llama_family, True, names)
    prompts, adapters = prompts_of([6, 19, 2], seed=5), ["ap8"] * 3
    got = graphs.generate(prompts, GREEDY, adapters)
    assert_same(got, eager.generate(prompts, GREEDY, adapters))
    for g, (toks, _) in zip(got, llama_oracle.generate(prompts, adapters, MAX_NEW)):
        assert g.token_ids == toks
    assert any(k[0] == 4 and k[1] and k[3] for k in graphs.runner.graphs.graph_keys)
    assert (fused[0] > 0) == (norm_shrink != "off")
    assert (graphs.runner.fused is not None) == (lora_gemm != "off")
    if lora_gemm != "off":
        assert any(k[0] == 4 for k in graphs.runner.graphs._fused_keys)
        assert graphs.runner.fused.num_installs >= 1


def test_one_slot_taken_in_turns_by_adapters_in_the_base_gemms(llama_family, llama_oracle,
                                                                monkeypatch):
    """FUSED_LORA_GEMM with one slot: adapters take turns in slot 0 (each batch's evicts
    the one before), so only the pool's generation tells the spare rows that they hold
    stale weights; every batch replays the same uniform graph and gives HF + PEFT's
    tokens."""
    from loramux_engine.lora import batch as batch_module
    monkeypatch.setattr(batch_module, "FUSED_LORA_GEMM", "all")
    eng = engine(llama_family, False, ["rs4", "ap8"], max_loras=1)
    for i, name in enumerate(["rs4", "ap8", "rs4"]):
        prompts, adapters = prompts_of([6, 19, 2], seed=10 + i), [name] * 3
        got = eng.generate(prompts, GREEDY, adapters)
        for g, (toks, _) in zip(got, llama_oracle.generate(prompts, adapters, MAX_NEW)):
            assert g.token_ids == toks, name
    assert eng.runner.fused.num_installs >= 3
    assert [k for k in eng.runner.graphs.graph_keys if k[3]] == \
        sorted(eng.runner.graphs._fused_keys)


def test_adapter_loaded_after_capture(llama_family, llama_oracle):
    graphs, eager = engine(llama_family, False, ["rs4"]), engine(llama_family, True, ["rs4"])
    prompts = prompts_of([7, 3, 12, 20], seed=2)
    first = ["rs4", None, "rs4", None]
    assert_same(graphs.generate(prompts, GREEDY, first), eager.generate(prompts, GREEDY, first))
    captured = dict(graphs.runner.graphs._graphs)
    for eng in (graphs, eager):
        eng.add_adapter("ap8", llama_family.adapters["ap8"])
        eng.add_adapter("attn32", llama_family.adapters["attn32"])
    later = ["ap8", "attn32", None, "ap8"]
    got = graphs.generate(prompts, GREEDY, later)
    assert_same(got, eager.generate(prompts, GREEDY, later))
    for g, (toks, _) in zip(got, llama_oracle.generate(prompts, later, MAX_NEW)):
        assert g.token_ids == toks
    # the same bucket's graph objects served the new adapters: nothing was re-captured
    for key, graph in captured.items():
        assert graphs.runner.graphs._graphs[key] is graph


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_greedy_pick_in_the_graph_matches_torch_pick(llama_family, llama_oracle, dtype,
                                                            monkeypatch):
    """engine/cuda_graph.py GREEDY_PICK "triton": the greedy graphs pick with the kernel
    (kernels/greedy_pick_triton.py, launched in their captures) and give the tokens and
    logprobs the torch pick gives in the same graphs (same logits: bf16 too); float32:
    the eager engine's and HF + PEFT's tokens too."""
    from loramux_engine import cuda_graph
    from loramux_kernels import greedy_pick_triton
    picks = []
    real = greedy_pick_triton.greedy_pick
    monkeypatch.setattr(greedy_pick_triton, "greedy_pick",
                        lambda x: picks.append(x.shape[0]) or real(x))
    names = ["rs4", "ap8"]
    prompts = prompts_of([5, 17, 1, 9, 30], seed=6)
    adapters = ["rs4", None, "ap8", "ap8", None]
    out = {}
    for pick in ("torch", "triton", "eager"):
        monkeypatch.setattr(cuda_graph, "GREEDY_PICK", "torch" if pick == "eager" else pick)
        eng = Engine(EngineConfig(model=str(llama_family.model_dir), device="cuda",
                                  dtype=dtype, max_loras=3, max_lora_rank=64, max_num_seqs=8,
                                  block_size=8, num_kv_blocks=128, max_model_len=256,
                                  enforce_eager=pick == "eager"))
        for name in names:
            eng.add_adapter(name, llama_family.adapters[name])
        picks.clear()
        out[pick] = eng.generate(prompts, GREEDY, adapters)
        if pick == "triton":
            assert picks and set(picks) <= set(eng.runner.graphs.buckets)
            assert eng.runner.graphs.num_replays >= MAX_NEW - 1
        else:
            assert not picks
    for g, w in zip(out["triton"], out["torch"]):
        assert g.token_ids == w.token_ids
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs)) < 1e-5
    if dtype == "float32":
        assert_same(out["triton"], out["eager"])
        for g, (toks, _) in zip(out["triton"], llama_oracle.generate(prompts, adapters, MAX_NEW)):
            assert g.token_ids == toks


def test_dummy_weights_finite_bf16(llama_family):
    eng = Engine(EngineConfig(model=str(llama_family.model_dir), device="cuda",
                              dtype="bfloat16", load_format="dummy", max_num_seqs=4,
                              num_kv_blocks=64, max_model_len=256))
    params = list(eng.model.parameters())
    assert all(torch.isfinite(p).all() for p in params)
    assert any(p.dim() == 2 and p.std() > 0 for p in params)
    out = eng.generate(prompts_of([9, 3], seed=3), GREEDY)
    assert all(len(o.token_ids) == MAX_NEW and all(lp == lp for lp in o.logprobs) for o in out)


def test_sampled_and_top_logprob_rows_match_eager(llama_family):
    """Rows the in-graph greedy pick leaves out (seeded sampling, top logprobs, penalty)
    take the hidden-state graph and the Sampler: same tokens and logprobs as eager."""
    names = ["rs4"]
    graphs, eager = engine(llama_family, False, names), engine(llama_family, True, names)
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_NEW, logprobs=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=True, top_logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=True,
                             repetition_penalty=1.3)]
    prompts, adapters = prompts_of([6, 13, 4], seed=4), ["rs4", None, "rs4"]
    got = graphs.generate(prompts, params, adapters)
    assert_same(got, eager.generate(prompts, params, adapters))
    assert got[1].top_logprobs and len(got[1].top_logprobs[0]) == 3
    assert any(k.bucket == 4 and k.lora and not k.greedy and not k.uniform
               for k in graphs.runner.graphs.graph_keys), graphs.runner.graphs.graph_keys


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy_graph", "sampler"])
def test_dora_and_end_lora_graphs_match_eager_and_hf(engine_family, greedy):
    """DoRA and LoRA on lm_head / embed_tokens beside a plain adapter and base rows: the
    graphs keyed by those extras (captured when first needed, after start-up) give the
    eager engine's tokens and logprobs and PEFT's tokens; `greedy`: lm_head's LoRA inside
    the greedy graph, else after the hidden-state graph (top logprobs take the Sampler)."""
    from tests.conftest import HFOracle
    names = ["dora", "ends", "plain"]
    graphs, eager = engine(engine_family, False, names), engine(engine_family, True, names)
    params = GREEDY if greedy else SamplingParams(temperature=0.0, max_tokens=MAX_NEW,
                                                  logprobs=True, top_logprobs=2)
    prompts = prompts_of([5, 17, 1, 9, 30, 4], seed=6)
    adapters = ["dora", None, "ends", "plain", "dora", "ends"]
    got = graphs.generate(prompts, params, adapters)
    assert_same(got, eager.generate(prompts, params, adapters))
    refs = HFOracle(engine_family).generate_each(prompts, adapters, MAX_NEW)
    for i, (g, (toks, _)) in enumerate(zip(got, refs)):
        assert g.token_ids == toks, f"request {i}: tokens differ from PEFT's"
    keys = graphs.runner.graphs.graph_keys
    assert any(k.dora and k.head and k.embed and k.greedy == greedy for k in keys), keys
    plain = graphs.generate(prompts[:2], params, ["plain", None])
    assert_same(plain, eager.generate(prompts[:2], params, ["plain", None]))
    assert any(k.lora and not (k.dora or k.head or k.embed) for k in graphs.runner.graphs.graph_keys)
