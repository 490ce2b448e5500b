"""A Llama-3-8B-shaped model directory (config, tokenizer, no weights: the engine runs it
with load_format="dummy") and rank-16 PEFT-layout adapters, for benchmarks. Nothing is
downloaded."""
from __future__ import annotations

import json
from pathlib import Path

import torch

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001,
    torch_dtype="bfloat16", hidden_act="silu", attention_bias=False,
)
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_model_dir(path: Path, num_layers: int | None = None, base: dict = LLAMA3_8B) -> Path:
    """config.json (`base`, Llama-3-8B by default), generation_config.json and a word-level
    tokenizer.json covering the whole vocabulary (benchmarks send token ids; the tokenizer
    only has to load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(base)
    if num_layers is not None:
        cfg["num_hidden_layers"] = num_layers
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": cfg["eos_token_id"]}))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def module_shapes(cfg: dict) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each LoRA target module."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def write_adapter(path: Path, model_dir: Path, rank: int = 16, seed: int = 0,
                  dora: bool = False, head: bool = False) -> Path:
    """A random rank-`rank` LoRA adapter on all seven projections, in PEFT layout; `dora`:
    a DoRA adapter (a magnitude vector per module, use_dora); `head`: LoRA on lm_head too."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = {f"model.layers.{layer}.{'self_attn' if mod in TARGETS[:4] else 'mlp'}.{mod}": io
              for layer in range(cfg["num_hidden_layers"])
              for mod, io in module_shapes(cfg).items()}
    if head:
        shapes["lm_head"] = (cfg["hidden_size"], cfg["vocab_size"])
    for name, (fin, fout) in shapes.items():
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fin, generator=gen) * 0.01).bfloat16()
        tensors[f"{key}.lora_B.weight"] = (torch.randn(fout, rank, generator=gen) * 0.01).bfloat16()
        if dora and name != "lm_head":
            tensors[f"{key}.lora_magnitude_vector"] = (
                1 + 0.1 * torch.rand(fout, generator=gen)).bfloat16()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(TARGETS) + ["lm_head"] * head, "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": dora,
        "modules_to_save": None, "base_model_name_or_path": str(model_dir),
    }, indent=2))
    return path


def weight_bytes(cfg: dict, batch: int, dtype_bytes: int = 2) -> int:
    """Bytes of base weights one decode step must read: every weight once, embedding rows
    only for the batch's tokens."""
    h, v, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    per_layer = sum(fi * fo for fi, fo in module_shapes(cfg).values()) + 2 * h
    head = v * h + h  # lm_head + final norm
    return dtype_bytes * (n * per_layer + head + batch * h)


def adapter_bytes(cfg: dict, rank: int, dtype_bytes: int = 2) -> int:
    n = cfg["num_hidden_layers"]
    return dtype_bytes * n * sum(rank * (fi + fo) for fi, fo in module_shapes(cfg).values())


def kv_bytes(cfg: dict, context_tokens: int, dtype_bytes: int = 2) -> int:
    per_tok = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes * cfg["num_hidden_layers"]
    return per_tok * context_tokens
