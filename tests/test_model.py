"""Base model vs Hugging Face transformers (float32, CPU): logits and argmax of one-step
prefill, chunked prefill through a shuffled paged cache, decode, and mixed batches, for
Llama (GQA), Qwen2 (qkv bias), Qwen3 (q/k norms), tied embeddings, llama3 rope scaling,
sharded checkpoints, Mistral with and without a sliding window shorter than the prompts;
plus bf16/fp16 runs and the LoRA hook placement."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.model.rotary import inverse_frequencies
from tests.support.tiny import TinySpec, load_hf_model, make_model

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
SPECS = {
    "llama_gqa": TinySpec(),
    "qwen2_bias": TinySpec(arch="qwen2", seed=1),
    "tied": TinySpec(tie_word_embeddings=True, seed=2),
    "llama3_rope": TinySpec(rope_scaling=LLAMA3, seed=3),
    "sharded": TinySpec(shard_size="40KB", seed=4),
    "mistral": TinySpec(seed=5),  # rewritten as MistralForCausalLM below
    "llama_attn_bias": TinySpec(seed=9),  # given q/k/v/o biases below
    "qwen3": TinySpec(arch="qwen3", seed=10),
    "mistral_window": TinySpec(arch="mistral", sliding_window=5, seed=11),
}
BLOCK = 4
PROMPT = [0, 17, 33, 99, 200, 7, 250, 9, 120, 11, 312, 45, 61]


def _as_mistral(path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    (path / "config.json").write_text(json.dumps(cfg))


def _with_attention_bias(path) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = True
    (path / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(0)
    for name in list(tensors):
        if name.endswith(("_proj.weight")) and ".self_attn." in name:
            rows = tensors[name].shape[0]
            tensors[name.replace(".weight", ".bias")] = torch.randn(rows, generator=gen) * 0.5
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    dirs = {}
    for name, spec in SPECS.items():
        dirs[name] = make_model(root / name, spec)
        if name == "mistral":
            _as_mistral(dirs[name])
        if name == "llama_attn_bias":
            _with_attention_bias(dirs[name])
    return dirs


@pytest.fixture(scope="module", params=list(SPECS))
def pair(request, model_dirs):
    """(name, our model, HF model) in float32."""
    path = model_dirs[request.param]
    ours = LlamaForCausalLM(ModelConfig.from_dir(path), torch.float32, "cpu")
    ours.load_weights(path)
    return request.param, ours, load_hf_model(path)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def run(model, kv, chunks):
    """One step: chunks = [(block_table, num_computed, token_ids)] -> logits per chunk."""
    attn = make_attention_metadata([c[0] for c in chunks], [c[1] for c in chunks],
                                   [len(c[2]) for c in chunks], BLOCK)
    ids = torch.tensor([t for c in chunks for t in c[2]])
    logits = model.compute_logits(model(ids, attn, kv))
    return list(logits.split([len(c[2]) for c in chunks]))


def assert_close(ours, ref, atol=1e-4):
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=atol, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_config_parsed(pair, model_dirs):
    name, ours, hf = pair
    cfg = ours.cfg
    assert (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (64, 4, 2, 16)
    assert cfg.qkv_bias == (name in ("qwen2_bias", "llama_attn_bias"))
    assert cfg.o_bias == (name == "llama_attn_bias")
    if cfg.o_bias:  # the biases must reach HF too, or parity would not test them
        assert hf.model.layers[0].self_attn.o_proj.bias.abs().sum() > 1
    assert cfg.tie_word_embeddings == (name == "tied")
    assert cfg.eos_token_ids == (1,) and cfg.bos_token_id == 0
    if name == "llama3_rope":
        assert dict(cfg.rope_scaling) == LLAMA3
        # the scaling must change the frequencies, or the parity test would not test it
        assert not torch.equal(inverse_frequencies(16, cfg.rope_theta, cfg.rope_scaling),
                               inverse_frequencies(16, cfg.rope_theta, None))
    if name == "sharded":
        assert len(list(model_dirs[name].glob("*.safetensors"))) > 1
        assert (model_dirs[name] / "model.safetensors.index.json").is_file()
    if name == "mistral":
        assert cfg.arch == "MistralForCausalLM" and type(hf).__name__ == "MistralForCausalLM"
    assert cfg.sliding_window == (5 if name == "mistral_window" else None)
    assert cfg.qk_norm == (name == "qwen3")
    if name == "qwen3":  # the norms must be loaded and not all ones, or parity would not test them
        assert type(hf).__name__ == "Qwen3ForCausalLM"
        norm = ours.layers[0].self_attn.q_norm.weight
        torch.testing.assert_close(norm, hf.model.layers[0].self_attn.q_norm.weight)
        assert (norm - 1).abs().max() > 0.05


def test_prefill_in_one_step(pair):
    _, ours, hf = pair
    kv = ours.make_kv_caches(8, BLOCK)
    (logits,) = run(ours, kv, [([5, 2, 7, 0], 0, PROMPT)])
    assert_close(logits, hf_logits(hf, PROMPT))


def test_chunked_prefill_then_decode(pair):
    _, ours, hf = pair
    kv = ours.make_kv_caches(32, BLOCK)
    for k_cache, v_cache in kv:  # stale garbage in unused slots must never be read
        k_cache.fill_(float("nan"))
        v_cache.fill_(float("nan"))
    table = torch.randperm(32, generator=torch.Generator().manual_seed(0))[:6].tolist()
    ref = hf_logits(hf, PROMPT)
    (first,) = run(ours, kv, [(table, 0, PROMPT[:6])])
    (second,) = run(ours, kv, [(table, 6, PROMPT[6:])])
    assert_close(torch.cat([first, second]), ref)
    tokens = list(PROMPT)
    for _ in range(5):
        tokens.append(int(hf_logits(hf, tokens)[-1].argmax()))
        (step,) = run(ours, kv, [(table, len(tokens) - 1, tokens[-1:])])
        assert_close(step[0], hf_logits(hf, tokens)[-1])


def test_mixed_prefill_and_decode_batch(pair):
    _, ours, hf = pair
    kv = ours.make_kv_caches(24, BLOCK)
    a, b, c = PROMPT[:7], PROMPT[3:12], [0, 5, 6, 300, 301, 302, 40, 41]
    ta, tb, tc = [9, 3], [20, 1, 14], [6, 11, 2]
    # step 1: a's whole prompt and c's first chunk together
    run(ours, kv, [(ta, 0, a[:6]), (tc, 0, c[:3])])
    # step 2: a decodes, b prefills from scratch, c continues its prefill
    la, lb, lc = run(ours, kv, [(ta, 6, a[6:]), (tb, 0, b), (tc, 3, c[3:])])
    assert_close(la, hf_logits(hf, a)[6:])
    assert_close(lb, hf_logits(hf, b))
    assert_close(lc, hf_logits(hf, c)[3:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes_load_and_run(model_dirs, dtype):
    path = model_dirs["qwen2_bias"]
    ours = LlamaForCausalLM(ModelConfig.from_dir(path), dtype, "cpu")
    ours.load_weights(path)
    assert all(p.dtype == dtype for p in ours.parameters())
    kv = ours.make_kv_caches(8, BLOCK)
    assert kv[0][0].dtype == dtype
    (logits,) = run(ours, kv, [([3, 1, 6, 0], 0, PROMPT)])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    ref = hf_logits(load_hf_model(path, dtype=dtype), PROMPT)
    exact = hf_logits(load_hf_model(path), PROMPT)
    # half precision differs in rounding order only: as close to HF (same dtype) as HF
    # in that dtype is to the float32 result
    budget = (ref - exact).abs().max().item()
    assert (logits - ref).abs().max().item() <= 2 * budget + 1e-3
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_half_checkpoint_loads_as_float32(tmp_path):
    path = make_model(tmp_path / "bf16", TinySpec(dtype="bfloat16", seed=6))
    cfg = ModelConfig.from_dir(path)
    assert cfg.torch_dtype == "bfloat16"
    ours = LlamaForCausalLM(cfg, torch.float32, "cpu")
    ours.load_weights(path)
    kv = ours.make_kv_caches(8, BLOCK)
    (logits,) = run(ours, kv, [([0, 1, 2, 3], 0, PROMPT)])
    hf = load_hf_model(path, dtype=torch.float32)
    assert_close(logits, hf_logits(hf, PROMPT))
