"""The model registry: each architecture declares its LoRA targets, and the geometry, the
slot pool and the adapter planner follow that declaration (nothing else names a module).

A variant of the tiny Llama registered under another class name, declaring the attention
projections only, is served as declared: two groups, no MLP buffers in the pool, and an
adapter that wraps an MLP projection is refused naming it."""
from __future__ import annotations

import dataclasses

import pytest

from loramux_engine.lora import LoRASlotPool, load_lora
from loramux_core.model import archs, lora_targets
from loramux_core.model.archs.base import Architecture
from loramux_core.model.archs.llama import ARCH as LLAMA
from loramux_core.model.hf_config import ModelConfig
from loramux_core.errors import AdapterError

MAX_RANK = 32


@pytest.mark.parametrize("arch", sorted(archs.ARCHITECTURES))
def test_every_architecture_declares_consistent_targets(arch):
    declared = archs.ARCHITECTURES[arch]
    assert declared.hf_name == arch and declared.lora_targets
    by_group: dict[str, list[int]] = {}
    for t in declared.lora_targets:
        assert t.parallel in ("column", "row") and len(t.dims) == 2
        by_group.setdefault(t.group, []).append(t.slice)
    for group, slices in by_group.items():  # slices side by side, in order, from 0
        assert slices == list(range(len(slices))), (group, slices)
    assert len({t.module for t in declared.lora_targets}) == len(declared.lora_targets)


@pytest.fixture
def attention_only(monkeypatch, llama_family):
    """The tiny Llama's config under an architecture that declares q/k/v/o only."""
    arch = Architecture("AttentionOnlyForCausalLM", LLAMA.fields, tuple(
        t for t in LLAMA.lora_targets if t.parent == "self_attn"))
    monkeypatch.setattr(archs, "ARCHITECTURES", {**archs.ARCHITECTURES, arch.hf_name: arch})
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    return cfg, dataclasses.replace(cfg, arch=arch.hf_name)


def test_geometry_and_pool_follow_the_declaration(attention_only):
    llama, attn = attention_only
    assert lora_targets.groups(llama) == ("qkv", "o", "gate_up", "down")
    assert lora_targets.groups(attn) == ("qkv", "o")
    assert lora_targets.row_parallel_groups(attn) == frozenset({"o"})
    shapes = lora_targets.lora_group_shapes(attn)
    assert shapes == {g: lora_targets.lora_group_shapes(llama)[g] for g in ("qkv", "o")}
    with pytest.raises(KeyError, match="gate_proj"):
        lora_targets.full_shape(attn, "gate_proj")
    pool = LoRASlotPool(attn, 2, MAX_RANK)
    assert pool.groups == ("qkv", "o")
    with pytest.raises(KeyError):
        pool.weights(0, "gate_up")


def test_planner_follows_the_declaration(attention_only, llama_family):
    _, attn = attention_only
    w = load_lora(llama_family.adapters["attn32"], attn, MAX_RANK)   # q/k/v/o: served
    assert {g for _, g in w.groups} == {"qkv", "o"}
    with pytest.raises(AdapterError, match="gate_proj|up_proj|down_proj"):
        load_lora(llama_family.adapters["rs4"], attn, MAX_RANK)      # wraps the MLP too


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen2_moe"])
def test_the_model_loads_its_projections_under_the_declared_names(arch, tmp_path):
    """The declaration is also the projections' weight-name mapping: every declared
    target's weight is one the model loads (and a checkpoint written by transformers
    has), for every registered family."""
    import torch
    from safetensors import safe_open

    from loramux_engine.model.build import build_model
    from loramux_engine.parallel import TPGroup
    from tests.support.tiny import TinySpec, make_model

    model_dir = make_model(tmp_path / arch, TinySpec(arch=arch, seed=3))
    cfg = ModelConfig.from_dir(model_dir)
    model = build_model(cfg, torch.float32, torch.device("cpu"), TPGroup.single())
    expected = set(model._loaders())
    with safe_open(str(next(model_dir.glob("*.safetensors"))), "pt") as f:
        written = set(f.keys())
    for layer in range(cfg.num_layers):
        for t in lora_targets.decoder_targets(cfg):
            name = f"model.layers.{layer}.{t.parent}.{t.module}.weight"
            assert name in expected and name in written, name
        for t in archs.architecture(cfg).expert_targets:   # the experts' own tensors
            for e in range(cfg.moe.num_experts):
                for module in t.modules:
                    name = f"model.layers.{layer}.{t.parent}.{e}.{module}.weight"
                    assert name in expected and name in written, name
    model.load_weights(model_dir)   # and nothing is missing or left over
