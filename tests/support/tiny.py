"""Tiny random Hugging Face models and PEFT adapters, written by transformers and peft
themselves so the files are exactly what users have.

Everything is seeded: the same call gives the same files. Weights are drawn wider than
the usual init so that greedy decoding has clear argmax margins (no near-ties that would
make token-for-token parity depend on summation order).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loramux_services.demo_model import train_byte_level_bpe

CORPUS = (
    "the quick brown fox jumps over the lazy dog. "
    "a multi adapter server shares one base model between many tenants. "
    "héllo wörld, ça va? naïve café. 你好，世界。 こんにちは 🙂🚀 "
    "def main(): return 42  # code tokens too\n"
    "once upon a time there was a tiny model that could.\n"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a small fixed corpus (offline, deterministic)."""
    return train_byte_level_bpe(CORPUS, vocab_size, SPECIAL_TOKENS)


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # "llama", "qwen2", "qwen3", "mistral" or "qwen2_moe"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    init_std: float = 0.08
    seed: int = 0
    dtype: str = "float32"
    shard_size: str | None = None  # e.g. "40KB" writes several *.safetensors + index
    sliding_window: int | None = None  # mistral only
    num_experts: int = 8             # qwen2_moe only: routed experts, of this width,
    moe_intermediate_size: int = 32  # top_k per token, and the shared expert's width
    top_k: int = 2
    shared_expert_intermediate_size: int = 48
    norm_topk_prob: bool = False


def _hf_config(spec: TinySpec, vocab_size: int):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        rope_theta=spec.rope_theta,
        initializer_range=spec.init_std,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        rms_norm_eps=1e-5,
    )
    if spec.rope_scaling is not None:
        common["rope_scaling"] = dict(spec.rope_scaling)
    if spec.arch == "llama":
        return LlamaConfig(**common)
    if spec.arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if spec.arch == "qwen3":
        return Qwen3Config(**common, head_dim=spec.hidden_size // spec.num_heads,
                           use_sliding_window=False)
    if spec.arch == "mistral":
        return MistralConfig(**common, sliding_window=spec.sliding_window)
    if spec.arch == "qwen2_moe":
        return Qwen2MoeConfig(
            **common, use_sliding_window=False, num_experts=spec.num_experts,
            num_experts_per_tok=spec.top_k, moe_intermediate_size=spec.moe_intermediate_size,
            shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
            norm_topk_prob=spec.norm_topk_prob)
    raise ValueError(f"unknown arch {spec.arch!r}")


def make_model(path: str | os.PathLike, spec: TinySpec = TinySpec()) -> Path:
    """Write a tiny random model directory (config.json, *.safetensors, tokenizer.json,
    generation_config.json) at `path` and return it."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab_size = tok.get_vocab_size()
    torch.manual_seed(spec.seed)
    cfg = _hf_config(spec, vocab_size)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, spec.init_std)
    model = model.to(getattr(torch, spec.dtype))
    kwargs = {"safe_serialization": True}
    if spec.shard_size:
        kwargs["max_shard_size"] = spec.shard_size
    model.save_pretrained(path, **kwargs)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.save_pretrained(path)
    return path


ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterSpec:
    r: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = ALL_TARGETS
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    seed: int = 1
    std: float = 0.15
    target_parameters: tuple[str, ...] = ()  # fused MoE expert weights (qwen2_moe)


def load_hf_model(model_dir: str | os.PathLike, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def make_adapter(path: str | os.PathLike, model_dir: str | os.PathLike,
                 spec: AdapterSpec = AdapterSpec(), *, save_embedding_layers=False,
                 **overrides) -> Path:
    """Write a random PEFT LoRA adapter for the model at `model_dir` through peft itself.

    Both A and B are random (PEFT's default B=0 would make every adapter the identity).
    `save_embedding_layers`: PEFT's save option ("auto", its default, also writes the
    whole base layer of a targeted embed_tokens or lm_head). `overrides` go to
    peft.LoraConfig as is, for writing adapters we must refuse (use_dora, bias,
    modules_to_save, ...)."""
    from peft import LoraConfig, get_peft_model

    path = Path(path)
    base = load_hf_model(model_dir)
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.lora_alpha,
        target_modules=list(spec.target_modules),
        use_rslora=spec.use_rslora,
        rank_pattern=dict(spec.rank_pattern),
        alpha_pattern=dict(spec.alpha_pattern),
        init_lora_weights=False,
        lora_dropout=0.0,
        **({"target_parameters": list(spec.target_parameters)} if spec.target_parameters else {}),
        **overrides,
    )
    peft_model = get_peft_model(base, cfg)
    gen = torch.Generator().manual_seed(spec.seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_magnitude_vector" in name:  # DoRA: PEFT's row norms, perturbed
                p.mul_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * spec.std)
    peft_model.save_pretrained(path, safe_serialization=True,
                               save_embedding_layers=save_embedding_layers)
    return path


def read_json(path: str | os.PathLike) -> dict:
    return json.loads(Path(path).read_text())


def write_json(path: str | os.PathLike, obj: dict) -> None:
    Path(path).write_text(json.dumps(obj, indent=2))
