"""DoRA and LoRA on lm_head / embed_tokens on the kernel path (kernels/lora/slot_rows.py
and the LoRA kernels, in Triton's interpreter on the CPU; natively on CUDA), against
transformers + PEFT: one forward pass of the engine's model over a mixed batch (a DoRA
adapter, one with LoRA on both ends, a plain one and base rows) gives every sequence the
logits PEFT gives it alone with its adapter, in the prefill and in the decode step after
it; the pool's host-side view of what a step's slots need (LoRAExtras); and the whole
engine's greedy tokens on that path against PEFT's; what a decode graph captures; two
tensor-parallel ranks."""
from __future__ import annotations

import pytest
import torch

from loramux_engine.lora import LoRABatch, LoRASlotPool, load_lora
from loramux_engine.lora.pool import LoRAExtras
from loramux_engine.model.batch import make_attention_metadata
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_core.model.hf_config import ModelConfig
from tests.conftest import TEST_DEVICE, HFOracle, TinyFamily
from tests.support.kernel_path import lora_kernel_path
from tests.support.tiny import AdapterSpec, TinySpec, load_hf_model, make_adapter, make_model
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SPECS = {
    "dora": (AdapterSpec(r=8, lora_alpha=16, seed=81, rank_pattern={"o_proj": 4}), {"use_dora": True}),
    "ends": (AdapterSpec(r=8, lora_alpha=16, seed=82, use_rslora=True,
                         target_modules=("q_proj", "down_proj", "lm_head", "embed_tokens")), {}),
    "plain": (AdapterSpec(r=4, lora_alpha=8, seed=83), {}),
}
SLOTS = {"dora": 0, "ends": 1, "plain": 2}
ROWS = ["dora", None, "ends", "plain", "dora", "ends"]    # one sequence each
LENGTHS = [7, 5, 9, 4, 3, 6]
BLOCK = 8


@pytest.fixture(scope="module", params=["own_head", "tied"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"extras_{request.param}")
    model_dir = make_model(root / "model", TinySpec(tie_word_embeddings=request.param == "tied",
                                                    seed=80))
    adapters = {name: make_adapter(root / name, model_dir, spec, **extra)
                for name, (spec, extra) in SPECS.items()}
    return model_dir, adapters


def _peft_logits(model_dir, adapters, name, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    model = load_hf_model(model_dir)
    if name is not None:
        model = PeftModel.from_pretrained(model, adapters[name]).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _engine_model(model_dir, adapters):
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, device=DEV)
    model.load_weights(model_dir)
    pool = LoRASlotPool(cfg, max_loras=4, max_lora_rank=16, device=DEV,
                        base_weight=model.lora_base_weight)
    for name, slot in SLOTS.items():
        w = load_lora(adapters[name], cfg, 16)
        pool.load(slot, w.pin_memory() if DEV == "cuda" else w)
    return model, pool


def _step(model, pool, kv, seqs, done, new, extras):
    """One forward pass over sequences `seqs` ((ids, adapter) each), `done[i]` tokens in
    the cache and the next `new[i]` run now; the logits of every token run."""
    ids = torch.tensor([t for (toks, _), d, n in zip(seqs, done, new) for t in toks[d:d + n]],
                       device=DEV)
    slots = torch.tensor([SLOTS[a] if a else -1 for (_, a), n in zip(seqs, new)
                          for _ in range(n)], dtype=torch.int32, device=DEV)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(seqs))]
    attn = make_attention_metadata(tables, done, new, BLOCK, DEV)
    lora = LoRABatch(pool, slots, extras=extras)
    hidden = model(ids, attn, kv, lora)
    return model.compute_logits(hidden, lora, torch.arange(ids.shape[0], device=DEV))


def test_mixed_forward_matches_peft(family):
    """With the extras the step's slots need (as the runner passes them)."""
    model_dir, adapters = family
    gen = torch.Generator().manual_seed(5)
    seqs = [(torch.randint(3, 250, (n,), generator=gen).tolist(), a)
            for n, a in zip(LENGTHS, ROWS)]
    model, pool = _engine_model(model_dir, adapters)
    assert pool.extras_of(SLOTS[a] for a in ROWS if a) == (True, True, True)
    assert pool.extras_of([SLOTS["plain"], -1]) == LoRAExtras()
    chosen = pool.extras_of(SLOTS[a] if a else -1 for a in ROWS)
    kv = model.make_kv_caches(4 * len(seqs), BLOCK)
    with lora_kernel_path() as calls:
        prefill = _step(model, pool, kv, seqs, [0] * len(seqs), [n - 1 for n in LENGTHS], chosen)
        decode = _step(model, pool, kv, seqs, [n - 1 for n in LENGTHS], [1] * len(seqs), chosen)
    at = 0
    for i, ((toks, name), n) in enumerate(zip(seqs, LENGTHS)):
        got = torch.cat([prefill[at:at + n - 1], decode[i:i + 1]]).cpu()
        at += n - 1
        want = _peft_logits(model_dir, adapters, name, toks)
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4,
                                   msg=lambda m: f"sequence {i} ({name}): {m}")
    # the kernels ran: per layer every group's scale, the embedding once, lm_head once; per
    # step (a group whose shrink ran fused into the norm or activation before it: its expand)
    assert calls["scale_rows"] == 2 * 4 * model.cfg.num_layers
    assert calls["add_embedding_lora"] == 2
    assert calls["add_lora"] + calls["expand_after"] >= 2 * 4 * 2 + 2


def test_base_rows_and_plain_slots_get_no_extras(family):
    """A step of base rows and a plain adapter only: with the step's extras (none) the
    slot-indexed ops do not run; with LoRABatch's default (every extra the pool has
    buffers for) they run and change nothing (factor 1, zero end LoRA on those slots)."""
    model_dir, adapters = family
    model, pool = _engine_model(model_dir, adapters)
    seqs = [([5, 9, 11, 40], None), ([7, 3, 99], "plain")]
    out = {}
    for extras in (pool.extras_of([-1, SLOTS["plain"]]), None):
        kv = model.make_kv_caches(8, BLOCK)
        with lora_kernel_path() as calls:
            out[extras] = _step(model, pool, kv, seqs, [0, 0], [4, 3], extras)
        assert (calls["scale_rows"] > 0) == (extras is None)
        assert (calls["add_embedding_lora"] > 0) == (extras is None)
    none, forced = out.values()
    torch.testing.assert_close(none, forced, atol=1e-6, rtol=0)


def test_reload_as_plain_resets_the_extras(family):
    """A DoRA / ends slot reloaded with a plain adapter: the host view drops it, and its
    factors are 1 and its end weights zero again."""
    model_dir, adapters = family
    _, pool = _engine_model(model_dir, adapters)
    cfg = ModelConfig.from_dir(model_dir)
    for name in ("dora", "ends"):
        pool.load(SLOTS[name], load_lora(adapters["plain"], cfg, 16))
        assert pool.extras_of([SLOTS[name]]) == LoRAExtras()
    assert all(torch.all(pool.dora_scale(0, g)[SLOTS["dora"]] == 1) for g in pool.groups)
    for module in ("lm_head", "embed_tokens"):
        a, b = pool.end_weights(module)
        assert not a[SLOTS["ends"]].any() and not b[SLOTS["ends"]].any()


@pytest.fixture(scope="module")
def engine_family(llama_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("extras_engine")
    adapters = {name: make_adapter(root / name, llama_family.model_dir, spec, **extra)
                for name, (spec, extra) in SPECS.items()}
    return TinyFamily("llama", llama_family.model_dir, {**adapters,
                                                       "rs4": llama_family.adapters["rs4"]})


def test_engine_greedy_matches_peft_on_the_kernel_path(engine_family):
    """The whole engine (prefill chunks, decode steps, the runner's extras) with every
    LoRA op on the Triton kernels: greedy tokens and logprobs equal PEFT's, each request
    run alone with its adapter, in one mixed batch of DoRA, both ends, plain adapters and
    base requests."""
    if DEV == "cuda" and TEST_DEVICE == "cpu":   # compiled kernels on CPU tensors
        pytest.skip("with CUDA the kernel path needs the engine there: LORAMUX_TEST_DEVICE=cuda")
    prompts = prompts_of([9, 1, 17, 5, 12, 3, 8], seed=21)
    names = ["dora", None, "ends", "plain", "dora", "rs4", "ends"]
    refs = HFOracle(engine_family).generate_each(prompts, names, MAX_NEW)
    with lora_kernel_path() as calls:
        eng = make_engine(engine_family)
        try:
            outs = eng.generate(prompts, GREEDY, names)
        finally:
            eng.close()
    assert_matches(outs, refs)
    assert calls["scale_rows"] and calls["add_embedding_lora"] and calls["add_lora"]


@pytest.mark.parametrize("greedy,pick", [(True, "torch"), (True, "triton"), (False, "torch")],
                         ids=["greedy_graph", "greedy_graph_triton_pick", "hidden_graph"])
def test_graph_forward_matches_the_eager_step(family, greedy, pick, monkeypatch):
    """What a decode graph captures (CudaGraphRunner._forward on its static buffers, a
    padded bucket), run here without capture: its key carries the rows' extras, and its
    greedy pick (lm_head LoRA inside), or its hidden states with the head's LoRA added
    after it (`head_lora`), equal the eager step's on the same cache. `pick`:
    engine/cuda_graph.py GREEDY_PICK; "triton" takes the kernel (on the CPU: the
    interpreter, the dispatch's CUDA check stood in for)."""
    from loramux_engine import cuda_graph
    from loramux_engine.cuda_graph import CudaGraphRunner
    from loramux_kernels import greedy_pick_triton
    from loramux_kernels import greedy_pick as pick_dispatch
    from loramux_kernels.greedy_pick import greedy_pick
    from tests.test_cuda_graph_logic import _sched
    monkeypatch.setattr(cuda_graph, "GREEDY_PICK", pick)
    monkeypatch.setattr(pick_dispatch, "_gpu", lambda x: True)
    kernel_picks = []
    real_pick = greedy_pick_triton.greedy_pick
    monkeypatch.setattr(greedy_pick_triton, "greedy_pick",
                        lambda x: kernel_picks.append(x.shape) or real_pick(x))
    model_dir, adapters = family
    model, pool = _engine_model(model_dir, adapters)
    gen = torch.Generator().manual_seed(8)
    names = ["ends", None, "dora", "plain", "ends"]
    rows = []
    for i, (name, length) in enumerate(zip(names, [6, 3, 9, 5, 2])):
        tokens = torch.randint(3, 250, (length,), generator=gen).tolist()
        rows.append(_sched(f"r{i}", tokens, length - 1, 1, [2 * i, 2 * i + 1],
                           SLOTS[name] if name else -1))
    kv = model.make_kv_caches(16, BLOCK, device=DEV)
    for k, v in kv:   # a random cache: every context token is "already computed"
        k.normal_(generator=gen) if DEV == "cpu" else k.normal_()
        v.normal_(generator=gen) if DEV == "cpu" else v.normal_()
    graphs = CudaGraphRunner(model, kv, pool, BLOCK, max_batch=8, max_model_len=16,
                             device=torch.device(DEV))
    key = graphs.key_for(rows, greedy)
    assert (key.bucket, key.lora, key.dora, key.head, key.embed) == (8, True, True, True, True)
    ids = torch.tensor([s.request.all_token_ids[s.start] for s in rows], device=DEV)
    slots = torch.tensor([s.slot for s in rows], dtype=torch.int32, device=DEV)
    attn = make_attention_metadata([list(s.block_ids) for s in rows], [s.start for s in rows],
                                   [1] * len(rows), BLOCK, DEV)
    with lora_kernel_path() as calls:
        lora = LoRABatch(pool, slots, extras=pool.extras_of(s.slot for s in rows))
        logits = model.compute_logits(model(ids, attn, kv, lora), lora,
                                      torch.arange(len(rows), device=DEV))
        graphs.staging.fill(rows, key.bucket)
        graphs.staging.upload()
        out = graphs._forward(key)   # the same KV writes again: same values
        if not greedy:
            out = model.compute_logits(out[:len(rows)], graphs.head_lora(key))
    assert calls["add_embedding_lora"] == 2
    assert len(kernel_picks) == (pick == "triton")
    if greedy:
        want = greedy_pick(logits)
        assert torch.equal(out[0, :len(rows)], want[0])
        torch.testing.assert_close(out[1, :len(rows)], want[1], atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(out, logits, atol=1e-5, rtol=1e-5)
    assert graphs.head_lora(key._replace(head=False)) is None


@pytest.mark.skipif(DEV != "cpu", reason="two gloo ranks as threads: the CPU (on CUDA: "
                    "tests/test_moe_tp.py with LORAMUX_TEST_DEVICE=cuda on two GPUs)")
def test_two_ranks_match_peft(family):
    """Tensor parallelism on the kernel path, two gloo ranks: DoRA on column-parallel
    groups (whole rows on a rank) and on row-parallel ones (o, down: the ranks' partial
    row norms summed by the all-reduce the first LoRA step settles), lm_head and
    embed_tokens LoRA (replicated on both ranks); every rank's logits equal PEFT's."""
    from loramux_engine.parallel import TPGroup
    from tests.support.ranks import two_ranks
    model_dir, adapters = family
    cfg = ModelConfig.from_dir(model_dir)
    gen = torch.Generator().manual_seed(6)
    seqs = [(torch.randint(3, 250, (n,), generator=gen).tolist(), a)
            for n, a in zip(LENGTHS, ROWS)]

    def rank(r, groups):
        tp = groups.tp
        model = LlamaForCausalLM(cfg, tp=tp)
        model.load_weights(model_dir)
        pool = LoRASlotPool(cfg, max_loras=4, max_lora_rank=16, tp_size=2,
                            base_weight=model.lora_base_weight, all_reduce=tp.all_reduce)
        for name, slot in SLOTS.items():
            pool.load(slot, load_lora(adapters[name], cfg, 16, tp=TPGroup(tp.rank, 2, None)))
        kv = model.make_kv_caches(4 * len(seqs), BLOCK)
        extras = pool.extras_of(SLOTS[a] if a else -1 for a in ROWS)
        return _step(model, pool, kv, seqs, [0] * len(seqs), LENGTHS, extras)

    with lora_kernel_path() as calls:
        out = two_ranks(rank, timeout_s=300)
    assert calls["scale_rows"] and calls["add_embedding_lora"] == 2
    at = 0
    for i, ((toks, name), n) in enumerate(zip(seqs, LENGTHS)):
        want = _peft_logits(model_dir, adapters, name, toks)
        for r in (0, 1):
            torch.testing.assert_close(out[r][at:at + n], want, atol=2e-4, rtol=2e-4,
                                       msg=lambda m: f"rank {r} sequence {i} ({name}): {m}")
        at += n
