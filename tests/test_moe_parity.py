"""Qwen2-MoE (top-k routed experts plus a gated shared expert) against transformers +
PEFT, greedy float32 on the CPU, token for token: the base model's logits (prefill and
decode over a paged cache), and one mixed batch of base requests, attention LoRA, expert
LoRA (PEFT `target_parameters` on the fused experts, with attention and shared-expert
LoRA beside it, and one on down_proj alone with its own rank), lm_head LoRA and DoRA, each
request equal to PEFT running its adapter alone (PEFT refuses mixed batches of parameter
LoRA and of DoRA)."""
import pytest
import torch

from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from tests.conftest import HFOracle, TinyFamily
from tests.support.tiny import AdapterSpec, TinySpec, load_hf_model, make_adapter, make_model
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
SPECS = {
    "attn": (AdapterSpec(r=8, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj",
                                                              "o_proj"), seed=51), {}),
    "moe": (AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj", "gate_proj",
                                                            "down_proj"),
                        target_parameters=EXPERTS, seed=52), {}),
    "moe_down": (AdapterSpec(r=8, lora_alpha=16, target_modules=(), seed=53,
                             target_parameters=("down_proj",), rank_pattern={"down_proj": 2}), {}),
    "head": (AdapterSpec(r=8, lora_alpha=16, target_modules=("v_proj", "lm_head"), seed=54), {}),
    "dora": (AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "o_proj", "up_proj",
                                                             "down_proj"), seed=55),
             {"use_dora": True}),
}
LENGTHS = [9, 1, 17, 40, 5, 12, 3, 23, 8, 30]
ADAPTERS = ["moe", None, "attn", "moe_down", "head", "dora", None, "moe", "dora", "moe_down"]
PROMPT = [0, 17, 33, 99, 200, 7, 250, 9, 120, 11, 312, 45, 61]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    model_dir = make_model(root / "model", TinySpec(arch="qwen2_moe", seed=50))
    adapters = {name: make_adapter(root / name, model_dir, spec, **extra)
                for name, (spec, extra) in SPECS.items()}
    return TinyFamily("qwen2_moe", model_dir, adapters)


@pytest.fixture(scope="module")
def engine(family):
    return make_engine(family)


def test_config(family):
    cfg = ModelConfig.from_dir(family.model_dir)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.intermediate_size) == (8, 2, 32)
    assert cfg.moe.shared_expert and cfg.intermediate_size == 48 and cfg.qkv_bias


@pytest.mark.parametrize("renormalized", [False, True], ids=["softmax_topk", "norm_topk_prob"])
def test_logits_match_transformers(family, tmp_path, renormalized):
    """Prefill all but the last token, then decode it, against one HF forward; routing
    weights as they are and renormalised over the top k."""
    model_dir = family.model_dir if not renormalized else make_model(
        tmp_path / "norm", TinySpec(arch="qwen2_moe", norm_topk_prob=True, top_k=3, seed=56))
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.moe.norm_topk_prob == renormalized
    model = LlamaForCausalLM(cfg)
    model.load_weights(model_dir)
    kv = model.make_kv_caches(8, 4)
    out = []
    for done, new in ((0, len(PROMPT) - 1), (len(PROMPT) - 1, 1)):
        attn = make_attention_metadata([[5, 2, 7, 1]], [done], [new], 4)
        out.append(model.compute_logits(model(torch.tensor(PROMPT[done:done + new]), attn, kv)))
    with torch.no_grad():
        ref = load_hf_model(model_dir)(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(torch.cat(out), ref, atol=1e-4, rtol=0)


def _oracle_each(family, prompts, adapters):
    """Each request through PEFT with only its own adapter loaded."""
    refs = [None] * len(prompts)
    for name in {a for a in adapters}:
        loaded = name or next(iter(family.adapters))  # base requests: adapter disabled
        fam = TinyFamily(family.arch, family.model_dir, {loaded: family.adapters[loaded]})
        oracle = HFOracle(fam)
        idx = [i for i, a in enumerate(adapters) if a == name]
        outs = oracle.generate_each([prompts[i] for i in idx], [name] * len(idx), MAX_NEW)
        for i, out in zip(idx, outs):
            refs[i] = out
    return refs


def test_mixed_batch_matches_peft(family, engine):
    prompts = prompts_of(LENGTHS, seed=11)
    refs = _oracle_each(family, prompts, ADAPTERS)
    outs = engine.generate(prompts, GREEDY, ADAPTERS)
    assert_matches(outs, refs)
    pool = engine.lora_pool
    assert pool.expert_slots and pool.dora_slots and pool.end_weights("lm_head") is not None


def test_expert_lora_matters(family, engine, tmp_path):
    """The same adapters without their expert factors give other logprobs (tokens, on a
    model this small, often agree): the expert LoRA is really applied."""
    from safetensors.torch import load_file, save_file

    from tests.support.tiny import read_json, write_json

    prompts = prompts_of([20, 30], seed=12)
    with_experts = [o.logprobs for o in engine.generate(prompts, GREEDY, ["moe", "moe_down"])]
    for i, name in enumerate(["moe", "moe_down"]):
        src, dst = family.adapters[name], tmp_path / name
        dst.mkdir()
        tensors = {k: v for k, v in load_file(src / "adapter_model.safetensors").items()
                   if ".experts." not in k}
        if not tensors:   # expert LoRA only: without it, the base model
            assert _differ(with_experts[i], engine.generate([prompts[i]], GREEDY)[0].logprobs)
            continue
        save_file(tensors, dst / "adapter_model.safetensors")
        write_json(dst / "adapter_config.json",
                   {**read_json(src / "adapter_config.json"), "target_parameters": None})
        engine.add_adapter(f"{name}_no_experts", dst)
        without = engine.generate([prompts[i]], GREEDY, [f"{name}_no_experts"])[0].logprobs
        assert _differ(with_experts[i], without)


def _differ(a: list[float], b: list[float]) -> bool:
    return max(abs(x - y) for x, y in zip(a, b)) > 1e-2


def test_memory_sizing_counts_the_experts(family):
    """engine/resolve.py's weight estimate is the checkpoint's size exactly (float32;
    the estimate leaves out biases, as for every family)."""
    from safetensors import safe_open

    from loramux_engine import EngineConfig
    from loramux_engine.resolve import weight_bytes

    with safe_open(str(family.model_dir / "model.safetensors"), "pt") as f:
        total = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in f.keys()
                    if not k.endswith(".bias"))
    cfg = EngineConfig(model=str(family.model_dir), dtype="float32")
    assert weight_bytes(ModelConfig.from_dir(family.model_dir), cfg) == 4 * total


def test_partial_adapters_load_over_poisoned_host_buffers(family, tmp_path, monkeypatch):
    """Host buffers hold anything when handed out (page-locked ones on CUDA come from
    torch.empty; reused ones hold the last adapter): every buffer is filled with NaN bytes
    before use, and adapters that fill only part of the host layout (attention only,
    expert down_proj only, ranks below the largest) still load and match PEFT. Only the
    bytes an adapter writes may be checked for finite values."""
    from loramux_engine.lora.host_buffers import HostBufferPool

    acquire = HostBufferPool.acquire

    def poisoned(self, nbytes, **kwargs):
        buf = acquire(self, nbytes, **kwargs)
        buf.data.fill_(0xFF)   # NaN in float32, bfloat16 and float16
        return buf
    monkeypatch.setattr(HostBufferPool, "acquire", poisoned)
    small = make_adapter(tmp_path / "small", family.model_dir,
                         AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"),
                                     rank_pattern={"v_proj": 1}, seed=57))
    names = {"attn": family.adapters["attn"], "moe_down": family.adapters["moe_down"],
             "small": small}
    fam = TinyFamily(family.arch, family.model_dir, names)
    eng = make_engine(fam, max_loras=3)
    adapters = ["moe_down", "attn", "small", None, "small", "moe_down"]
    prompts = prompts_of([7, 12, 5, 9, 16, 3], seed=13)
    refs = _oracle_each(fam, prompts, adapters)
    assert_matches(eng.generate(prompts, GREEDY, adapters), refs)
