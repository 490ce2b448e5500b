"""The demo model `loramux serve` uses when given none: a small random Llama with a
byte-level BPE tokenizer and two LoRA adapters, written once into a cache directory in
Hugging Face / PEFT layout by our own code (safetensors + tokenizers + torch only), so a
fresh machine needs neither transformers nor peft to serve."""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_CORPUS = (
    "the quick brown fox jumps over the lazy dog. a server shares one base model between "
    "many adapters, and every adapter changes what the model says. héllo wörld, ça va? "
    "你好，世界。 こんにちは 🙂 def main(): return 42\nonce upon a time there was a model.\n")
_SPECIALS = ("<s>", "</s>", "<pad>")
_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEMO_ADAPTERS = ("demo-a", "demo-b")
SERVED_NAME = "loramux-demo"  # the demo model's name in the HTTP API (not its path)
DEMO_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@dataclass(frozen=True)
class DemoSpec:
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    lora_rank: int = 8
    seed: int = 0


def default_cache_dir() -> Path:
    base = os.environ.get("LORAMUX_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "loramux")
    return Path(base)


def ensure_demo(cache_dir: str | os.PathLike | None = None, spec: DemoSpec = DemoSpec()) -> Path:
    """The demo directory (model files, adapters/demo-a, adapters/demo-b), made on the first
    call; built in a temporary directory and renamed, so a crash leaves nothing half-made."""
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    demo = root / "demo"
    if (demo / "config.json").exists():
        return demo
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=root))
    try:
        write_model(tmp, spec)
        for i, name in enumerate(DEMO_ADAPTERS, start=1):
            write_adapter(tmp / "adapters" / name, spec, seed=spec.seed + 100 * i)
        os.replace(tmp, demo)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (demo / "config.json").exists():  # not a concurrent maker that won
            raise
    return demo


def train_byte_level_bpe(corpus: str, vocab_size: int, specials: Sequence[str]):
    """A byte-level BPE tokenizer (a `tokenizers.Tokenizer`) trained on `corpus`, with
    `specials` as its first ids: offline and deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(specials),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([corpus] * 4, trainer=trainer)
    return tok


def write_model(path: Path, spec: DemoSpec) -> None:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tok = train_byte_level_bpe(_CORPUS, spec.vocab_size, _SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    h, inter, hd = spec.hidden_size, spec.intermediate_size, spec.hidden_size // spec.num_heads
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": hd, "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "torch_dtype": "float32"}
    _write_json(path / "config.json", config)
    _write_json(path / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 1,
                                                  "pad_token_id": 2})
    _write_json(path / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "model_max_length": spec.max_position_embeddings,
        "chat_template": DEMO_CHAT_TEMPLATE})
    g = torch.Generator().manual_seed(spec.seed)

    def rand(*shape, std=0.08):
        return (torch.randn(*shape, generator=g) * std).contiguous()

    kv = spec.num_kv_heads * hd
    tensors = {"model.embed_tokens.weight": rand(vocab, h), "lm_head.weight": rand(vocab, h),
               "model.norm.weight": 1.0 + rand(h, std=0.1)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        for name, shape in _module_shapes(h, inter, kv).items():
            tensors[p + name + ".weight"] = rand(*shape)
        tensors[p + "input_layernorm.weight"] = 1.0 + rand(h, std=0.1)
        tensors[p + "post_attention_layernorm.weight"] = 1.0 + rand(h, std=0.1)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def _module_shapes(h: int, inter: int, kv: int) -> dict[str, tuple[int, int]]:
    """(out, in) of every LoRA-targetable linear layer, by its module path in a layer."""
    return {"self_attn.q_proj": (h, h), "self_attn.k_proj": (kv, h), "self_attn.v_proj": (kv, h),
            "self_attn.o_proj": (h, h), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def write_adapter(path: Path, spec: DemoSpec, seed: int) -> None:
    """A PEFT-layout LoRA adapter on every linear layer, A and B both random."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    h, hd = spec.hidden_size, spec.hidden_size // spec.num_heads
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(spec.num_layers):
        for name, (out, inp) in _module_shapes(h, spec.intermediate_size,
                                               spec.num_kv_heads * hd).items():
            p = f"base_model.model.model.layers.{i}.{name}"
            tensors[p + ".lora_A.weight"] = (torch.randn(spec.lora_rank, inp, generator=g) * 0.15).contiguous()
            tensors[p + ".lora_B.weight"] = (torch.randn(out, spec.lora_rank, generator=g) * 0.15).contiguous()
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    _write_json(path / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None,
        "r": spec.lora_rank, "lora_alpha": 2 * spec.lora_rank, "lora_dropout": 0.0,
        "target_modules": list(_TARGETS), "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "inference_mode": True,
        "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))


def main(argv: list[str] | None = None) -> int:
    """`python -m loramux_services.demo_model DIR`: make the demo model under DIR/demo (once)."""
    import sys

    argv = sys.argv[1:] if argv is None else argv
    print(ensure_demo(argv[0] if argv else None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
