"""Model directories the engine must refuse, each with a ModelLoadError that names the
file and the field or tensor at fault."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.parallel import TPGroup
from loramux_core.errors import ModelLoadError
from tests.support.tiny import TinySpec, make_model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("base") / "llama", TinySpec())


def _copy(base_dir, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(base_dir, dst)
    return dst


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))


_DROP = object()

BAD_CONFIGS = [
    (dict(architectures=["GPT2LMHeadModel"]), "architectures"),
    (dict(hidden_size=_DROP), "'hidden_size' is missing"),
    (dict(num_attention_heads=0), "num_attention_heads=0"),
    (dict(num_key_value_heads=3), "num_key_value_heads=3"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}),
     "rope_parameters.rope_type='yarn'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}),
     "rope_parameters.low_freq_factor"),
    (dict(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=64),
     "sliding_window=64"),
    (dict(architectures=["Qwen3ForCausalLM"], use_sliding_window=True, sliding_window=64),
     "sliding_window=64"),
    (dict(architectures=["MistralForCausalLM"], sliding_window=0), "sliding_window=0"),
    (dict(eos_token_id="x"), "eos_token_id"),
]


@pytest.mark.parametrize("changes,needle", BAD_CONFIGS)
def test_bad_config_refused(base_dir, tmp_path, changes, needle):
    path = _copy(base_dir, tmp_path)
    _edit_config(path, **changes)
    (path / "generation_config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json") as err:
        ModelConfig.from_dir(path)
    assert needle in str(err.value)


def test_missing_or_broken_config(base_dir, tmp_path):
    path = _copy(base_dir, tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: cannot be parsed"):
        ModelConfig.from_dir(path)
    (path / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json not found"):
        ModelConfig.from_dir(path)


def test_transformers4_rope_layout(base_dir, tmp_path):
    path = _copy(base_dir, tmp_path)
    _edit_config(path, rope_parameters=_DROP, rope_theta=5e5,
                 rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    cfg = ModelConfig.from_dir(path)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"


def test_eos_list_from_generation_config(base_dir, tmp_path):
    path = _copy(base_dir, tmp_path)
    gen = json.loads((path / "generation_config.json").read_text())
    gen["eos_token_id"] = [1, 2]
    (path / "generation_config.json").write_text(json.dumps(gen))
    assert ModelConfig.from_dir(path).eos_token_ids == (1, 2)


def test_pickle_only_directory_refused(base_dir, tmp_path, monkeypatch):
    path = tmp_path / "pickled"
    path.mkdir()
    shutil.copy(base_dir / "config.json", path)
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")

    def never(*a, **k):
        raise AssertionError("torch.load must never be called")
    monkeypatch.setattr(torch, "load", never)
    model = LlamaForCausalLM(ModelConfig.from_dir(path))
    with pytest.raises(ModelLoadError, match=r"only pickle checkpoints \(pytorch_model.bin\)"):
        model.load_weights(path)


def test_no_weights_refused(base_dir, tmp_path):
    path = tmp_path / "empty"
    path.mkdir()
    shutil.copy(base_dir / "config.json", path)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LlamaForCausalLM(ModelConfig.from_dir(path)).load_weights(path)


def _rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
     "'model.layers.1.mlp.up_proj.weight' is missing from the model's safetensors files (model.safetensors)"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(64)}),
     "unexpected tensor 'model.layers.0.self_attn.q_proj.bias' in model.safetensors"),
    (lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.ones(48, 64)}),
     "'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape [48, 64], expected [32, 64]"),
    (lambda t: t.update({"model.norm.weight": torch.ones(65)}),
     "'model.norm.weight' in model.safetensors has shape [65], expected [64]"),
])
def test_bad_weights_refused(base_dir, tmp_path, edit, needle):
    path = _copy(base_dir, tmp_path)
    _rewrite_weights(path, edit)
    model = LlamaForCausalLM(ModelConfig.from_dir(path))
    with pytest.raises(ModelLoadError) as err:
        model.load_weights(path)
    assert needle in str(err.value)


def test_index_naming_absent_file_refused(tmp_path):
    path = make_model(tmp_path / "sharded", TinySpec(shard_size="40KB"))
    victim = sorted(path.glob("*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(ModelLoadError, match=f"lists '{victim.name}'"):
        LlamaForCausalLM(ModelConfig.from_dir(path)).load_weights(path)


def test_indivisible_tensor_parallel_refused(base_dir):
    cfg = ModelConfig.from_dir(base_dir)  # 4 heads, 2 KV heads, intermediate 128
    with pytest.raises(ModelLoadError, match="num_attention_heads=4 is not divisible"):
        LlamaForCausalLM(cfg, tp=TPGroup(rank=0, size=3))
