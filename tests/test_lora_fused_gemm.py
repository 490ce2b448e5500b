"""One adapter inside the base GEMMs (engine/lora/fused.py, engine/lora/batch.py
FUSED_LORA_GEMM): o's and down's shrink as extra output rows of their base weights,
q/k/v's and gate/up's expand as extra input columns beside the norm's output.

The expand that finishes it (loramux_kernels.lora.expand_rows) against the torch reference on
strided views of one GEMM output, random B, ranks below the pool's, base rows; then the
tiny Llama with the spare rows, its LoRA kernels in Triton's interpreter on the CPU
(natively on CUDA), against transformers + PEFT and against the same model without the
fused path: an adapter switch between steps, a slot loaded again with another adapter
under the same slot number (the pool's generation), ranks below max_lora_rank, padding
rows without an adapter; and the whole engine's eager steps on that path, adapters taking
turns in one slot, against PEFT's greedy tokens; the benchmark's switch."""
from __future__ import annotations

import pytest
import torch

from loramux_engine.lora import LoRABatch, LoRASlotPool, load_lora
from loramux_engine.lora import batch as batch_module
from loramux_engine.lora.fused import FusedAdapter
from loramux_engine.model.batch import make_attention_metadata
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_kernels.lora import launch
from loramux_kernels.lora.launch import build_meta
from loramux_kernels.lora.reference import lora_expand_ref
from loramux_core.model.hf_config import ModelConfig
from tests.support.kernel_path import lora_kernel_path
from tests.support.lora_pool import slot_pool
from tests.support.tiny import AdapterSpec, TinySpec, load_hf_model, make_adapter, make_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"
MAX_RANK = 16
BLOCK = 8
SPECS = {"r4": AdapterSpec(r=4, lora_alpha=8, seed=91),
         "r8": AdapterSpec(r=8, lora_alpha=16, seed=92, use_rslora=True),
         "other": AdapterSpec(r=8, lora_alpha=32, seed=93)}


@pytest.mark.parametrize("T", [1, 5, 19, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expand_rows_matches_reference(T, dtype):
    """y and s as the two column ranges of one [T, N + R] output; slots 0..2 of ranks
    3, 16, 7 (zero-padded past them) and base rows; the Triton expand adds what the
    reference adds, nothing to base rows, and leaves s alone."""
    with lora_kernel_path():
        N, R = 72, MAX_RANK
        g = torch.Generator().manual_seed(T)
        _, b, ranks = slot_pool(1, (0, N), [3, 16, 7], 8, dtype, DEV, R, seed=T)
        slot = int(torch.randint(0, 3, (1,), generator=g))
        ts = torch.where(torch.rand(T, generator=g) < 0.25, -1, slot).to(DEV, torch.int32)
        out = torch.randn(T, N + R, generator=g).to(DEV, dtype)
        before, want = out.clone(), out.clone()
        lora_expand_ref(want[:, N:].float()[None], b, ts, (0, N), want[:, :N])
        from loramux_kernels import lora as lora_kernels
        lora_kernels.expand_rows(out[:, :N], out[:, N:], b, ts, ranks, build_meta(ts, 3))
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-2, rtol=2e-2)
    torch.testing.assert_close(out, want, **tol)
    base = ts < 0
    assert torch.equal(out[base], want[base])
    if (~base).any():                                  # the adapter really contributes
        assert (want[~base, :N] - before[~base, :N]).abs().max() > 0.1


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused_gemm")
    model_dir = make_model(root / "model", TinySpec(seed=90))
    return model_dir, {n: make_adapter(root / n, model_dir, s) for n, s in SPECS.items()}


def _peft_logits(model_dir, adapter_dir, ids: list[int]) -> torch.Tensor:
    from peft import PeftModel
    model = load_hf_model(model_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


def _step(model, pool, fused, seqs, slot):
    """One prefill of `seqs` (token lists): the first on `slot`, the others without an
    adapter (a padded bucket's rows); the logits of every token, and the LoRA launches
    by name."""
    ids = torch.tensor([t for s in seqs for t in s], device=DEV)
    slots = torch.tensor([slot] * len(seqs[0]) + [-1] * (ids.shape[0] - len(seqs[0])),
                         dtype=torch.int32, device=DEV)
    tables = [list(range(4 * i, 4 * i + 4)) for i in range(len(seqs))]
    attn = make_attention_metadata(tables, [0] * len(seqs), [len(s) for s in seqs], BLOCK, DEV)
    kv = model.make_kv_caches(4 * len(seqs), BLOCK)
    with pytest.MonkeyPatch.context() as mp, lora_kernel_path() as calls:
        for name in ("expand_rows", "add_norm_shrink_cols"):
            inner = getattr(launch, name)
            mp.setattr(launch, name,
                       lambda *a, n=name, f=inner: calls.update([n]) or f(*a))
        lora = LoRABatch(pool, slots, fused=fused)
        logits = model.compute_logits(model(ids, attn, kv, lora), lora,
                                      torch.arange(ids.shape[0], device=DEV))
    return logits.cpu(), dict(calls)


# FUSED_LORA_GEMM -> the LoRA launches of a fused step of the tiny Llama (L layers)
LAUNCHES = {
    # o's and down's expand of their GEMM's shrink; q/k/v and gate/up as usual (on the
    # CPU without the norm's fused shrink, which needs CUDA rows)
    # (on CUDA the norms start q/k/v's and gate/up's shrink: their expand finishes it)
    "rows": lambda L: {"expand_rows": 2 * L,
                       "expand_after" if DEV == "cuda" else "add_lora": 2 * L},
    # and two norms a layer writing their shrink as columns for the GEMMs after them
    "cols": lambda L: {"expand_rows": 2 * L, "add_norm_shrink_cols": 2 * L},
    # those norms also add the expand of the group before: the last down's is left
    "all": lambda L: {"expand_rows": 1, "add_norm_shrink_cols": 2 * L},
}


@pytest.mark.parametrize("mode", list(LAUNCHES))
def test_one_adapter_in_the_base_gemm_matches_peft(family, mode, monkeypatch):
    """Every step's adapter rows and base rows give PEFT's logits on the fused path (the
    LoRA launches LAUNCHES says, no other), equal to the unfused path's; the spare rows
    and columns are copied again on a switch of slot and on a new load into the same
    slot, not for a step on the slot they hold."""
    monkeypatch.setattr(batch_module, "FUSED_LORA_GEMM", mode)
    model_dir, adapters = family
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, device=DEV, fused_lora_rank=MAX_RANK)
    model.load_weights(model_dir)
    pool = LoRASlotPool(cfg, max_loras=2, max_lora_rank=MAX_RANK, device=DEV)
    pool.load(0, load_lora(adapters["r4"], cfg, MAX_RANK))
    pool.load(1, load_lora(adapters["r8"], cfg, MAX_RANK))
    fused = FusedAdapter(pool, model.fused_lora_weights())
    assert len(fused.targets) == 4 * cfg.num_layers
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(3, 250, (6,), generator=gen).tolist()
    pad = torch.randint(3, 250, (3,), generator=gen).tolist()
    base = _peft_logits(model_dir, None, pad)
    installs = []
    for slot, name in ((0, "r4"), (1, "r8"), (1, "r8"), (1, "other"), (0, "r4")):
        if name == "other":          # the slot the rows hold, loaded with new weights
            pool.load(1, load_lora(adapters["other"], cfg, MAX_RANK))
        fused.install(slot)
        installs.append(fused.num_installs)
        got, calls = _step(model, pool, fused, [prompt, pad], slot)
        assert calls == LAUNCHES[mode](cfg.num_layers), name
        want = _peft_logits(model_dir, adapters[name], prompt)
        torch.testing.assert_close(got[:6], want, atol=2e-4, rtol=2e-4,
                                   msg=lambda m: f"slot {slot} ({name}): {m}")
        torch.testing.assert_close(got[6:], base, atol=2e-4, rtol=2e-4)
        plain, calls = _step(model, pool, None, [prompt, pad], slot)
        # every group the usual way (on CUDA the norms and the SiLU may start a shrink,
        # which their expand finishes)
        assert (calls.get("add_lora", 0) + calls.get("expand_after", 0) == 4 * cfg.num_layers
                and "expand_rows" not in calls), calls
        torch.testing.assert_close(got, plain, atol=2e-5, rtol=2e-5)
    assert installs == [1, 2, 2, 3, 4]


def test_spare_rows_leave_the_base_weights_as_they_were(family):
    """`weight` of o_proj and down_proj is the first rows of [W; A], contiguous, that of
    qkv_proj and gate_up_proj the first columns of [W | B]; the spare rows and columns
    start zeroed and are not parameters (not loaded, not in the state)."""
    model_dir, _ = family
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, device=DEV, fused_lora_rank=MAX_RANK)
    model.load_weights(model_dir)
    plain = LlamaForCausalLM(cfg, device=DEV)
    plain.load_weights(model_dir)
    assert set(model.state_dict()) == set(plain.state_dict())
    for (layer, group), storage in model.fused_lora_weights().items():
        attn, mlp = model.layers[layer].self_attn, model.layers[layer].mlp
        lin = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj,
               "down": mlp.down_proj}[group]
        assert lin.weight.data_ptr() == storage.data_ptr()
        rows, cols = lin.weight.shape
        if group in ("o", "down"):
            assert lin.weight.is_contiguous() and storage.shape == (rows + MAX_RANK, cols)
            assert not storage[rows:].any()
        else:       # one block of spare columns per slice; the matmul reads the view as is
            slices = len(lin.out_widths)
            assert storage.shape == (rows, cols + slices * MAX_RANK)
            assert lin.weight.stride() == storage.stride() and storage.stride(1) == 1
            assert storage.stride(0) % 64 == 0      # 128-byte rows in bf16: aligned for a GEMM
            assert not storage[:, cols:].any()
    torch.testing.assert_close(model.state_dict(), plain.state_dict(), atol=0, rtol=0)
    assert plain.fused_lora_weights() == {}


def test_bench_decode_switches_lora_gemm(monkeypatch):
    """bench_decode --lora-gemm: each setting sets FUSED_LORA_GEMM and drops the
    captured graphs when it changes; rows of a later setting are labelled apart."""
    import importlib
    from types import SimpleNamespace
    bench = importlib.import_module("benchmarks.bench_decode")
    monkeypatch.setattr(batch_module, "FUSED_LORA_GEMM", "all")
    monkeypatch.setattr(bench, "_DEFAULT_PATH", {})
    released = []
    eng = SimpleNamespace(runner=SimpleNamespace(
        graphs=SimpleNamespace(release=lambda: released.append(1))))
    for setting, want, n_released in (("default", "all", 0), ("off", "off", 1),
                                      ("off", "off", 1), ("rows", "rows", 2),
                                      ("default", "all", 3)):
        bench.select_lora_gemm(eng, setting)
        assert batch_module.FUSED_LORA_GEMM == want
        assert len(released) == n_released, setting
    assert bench.gemm_label("one", "all", ["all", "off"]) == "one"
    assert bench.gemm_label("one/gp-torch", "off", ["all", "off"]) == "one/gp-torch/lg-off"


def test_engine_takes_the_gemms_for_adapters_in_turns(llama_family, monkeypatch):
    """The whole engine on the CPU with the spare rows and columns (the model built as on
    CUDA) and the LoRA kernels in Triton's interpreter, one slot: rs4, then ap8, then rs4
    again take turns in slot 0, each for a batch of its own (eager prefill and decode
    steps, every one on the fused GEMMs: no add_lora); greedy tokens and logprobs equal
    PEFT's, and the spare room was filled again at each turn."""
    from loramux_engine import assembly
    from tests.conftest import HFOracle
    from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of
    monkeypatch.setattr(batch_module, "FUSED_LORA_GEMM", "all")
    monkeypatch.setattr(assembly, "build_model",
                        lambda cfg, dtype, device, tp, fused_lora_rank=0: LlamaForCausalLM(
                            cfg, dtype, device, tp, fused_lora_rank=fused_lora_rank))
    oracle = HFOracle(llama_family)
    with lora_kernel_path() as calls:
        eng = make_engine(llama_family, max_loras=1)
        try:
            assert eng.runner.fused is not None
            for i, name in enumerate(["rs4", "ap8", "rs4"]):
                prompts = prompts_of([5, 11], seed=30 + i)
                outs = eng.generate(prompts, GREEDY, [name, name])
                assert_matches(outs, oracle.generate_each(prompts, [name, name], MAX_NEW))
            assert eng.runner.fused.num_installs == 3
        finally:
            eng.close()
    assert calls["add_lora"] == 0 and calls["expand_after"] == 0
