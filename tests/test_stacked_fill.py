"""The stacked fill of an adapter's host copy (engine/lora/stacked_fill.py) writes the same
bytes as the layer-by-layer fill, for every dtype, scaling, rank pattern and tensor-
parallel cut, and is really taken where it applies."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_engine.lora import stacked_fill
from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_engine.lora.weights import weights_from_plan
from loramux_engine.parallel import TPGroup
from loramux_core.adapter.plan import plan_adapter
from loramux_core.model.hf_config import ModelConfig
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

WEIGHTS = "adapter_model.safetensors"
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """12 layers, so the file's lexicographic layer order (0, 1, 10, 11, 2, ...) is not
    the layer order."""
    root = tmp_path_factory.mktemp("stacked_fill")
    model_dir = make_model(root / "model", TinySpec(num_layers=12))
    dirs = {
        "uniform": make_adapter(root / "uniform", model_dir, AdapterSpec(
            r=8, lora_alpha=12, target_modules=ALL, seed=1)),
        "mixed": make_adapter(root / "mixed", model_dir, AdapterSpec(
            r=4, rank_pattern={"k_proj": 8}, target_modules=("q_proj", "k_proj", "down_proj"),
            seed=2)),
        "layer_rank": make_adapter(root / "layer_rank", model_dir, AdapterSpec(
            r=4, rank_pattern={"model.layers.3.self_attn.q_proj": 8}, target_modules=ALL,
            seed=3)),
        "some_layers": make_adapter(root / "some_layers", model_dir, AdapterSpec(
            r=4, target_modules=ALL, seed=4), layers_to_transform=[0, 2, 5]),
    }
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        src = dirs["uniform"]
        dst = root / name
        dst.mkdir()
        (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
        save_file({k: v.to(dtype) for k, v in load_file(src / WEIGHTS).items()}, dst / WEIGHTS)
        dirs[name] = dst
    return ModelConfig.from_dir(model_dir), dirs


def build(cfg, path, dtype, tp, fast: bool):
    plan = plan_adapter(path, cfg, 16)
    return weights_from_plan(plan, cfg, tp, dtype, HostBufferPool(), stacked_fill=fast)


def count_fast(monkeypatch) -> list:
    taken = []
    real = stacked_fill.fill_stacked

    def spy(*args):
        ranks = real(*args)
        taken.append(ranks is not None)
        return ranks
    monkeypatch.setattr("loramux_engine.lora.weights.fill_stacked", spy)
    return taken


@pytest.mark.parametrize("name", ["uniform", "mixed", "layer_rank", "some_layers", "fp16",
                                  "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [TPGroup.single(), TPGroup(rank=1, size=2)],
                         ids=["tp1", "tp2rank1"])
def test_same_bytes_as_layer_by_layer(family, monkeypatch, name, dtype, tp):
    cfg, dirs = family
    taken = count_fast(monkeypatch)
    fast = build(cfg, dirs[name], dtype, tp, fast=True)
    slow = build(cfg, dirs[name], dtype, tp, fast=False)
    assert fast.buffer_bytes == slow.buffer_bytes > 0
    assert torch.equal(fast.buffer.data[:fast.buffer_bytes], slow.buffer.data[:slow.buffer_bytes])
    assert fast.groups.keys() == slow.groups.keys()
    for key, g in fast.groups.items():
        assert g.slice_ranks == slow.groups[key].slice_ranks, key
        assert torch.equal(g.a, slow.groups[key].a) and torch.equal(g.b, slow.groups[key].b)
    # where every layer wraps a slice alike, the group is filled at once; a layer of
    # another rank (a larger block in the file) leaves the offsets uneven: layer by layer
    expect = {"uniform": [True] * 4, "fp16": [True] * 4, "bf16": [True] * 4,
              "mixed": [True, True], "layer_rank": [False] * 4,
              "some_layers": [False] * 4}[name]
    assert taken == expect


def test_scaling_and_padding_are_in_place(family):
    """Slices of a smaller rank than the group's leave zeros; B carries the scaling."""
    cfg, dirs = family
    w = build(cfg, dirs["mixed"], torch.float32, TPGroup.single(), fast=True)
    tensors = load_file(dirs["mixed"] / WEIGHTS)
    g = w.groups[(10, "qkv")]
    assert g.slice_ranks == (4, 8, 0)
    q_a = tensors["base_model.model.model.layers.10.self_attn.q_proj.lora_A.weight"]
    q_b = tensors["base_model.model.model.layers.10.self_attn.q_proj.lora_B.weight"]
    assert torch.equal(g.a[0, :4], q_a) and not g.a[0, 4:].any() and not g.a[2].any()
    scaling = 16 / 4  # AdapterSpec.lora_alpha over r
    assert torch.equal(g.b[:q_b.shape[0], :4], q_b * scaling)
    assert not g.b[:q_b.shape[0], 4:].any()


def test_a_host_copy_keeps_its_groups_as_rows_of_the_stacked_tensors(family):
    """The per-(layer, group) GroupWeights are made when asked for, rows of the stacked
    tensors, so a host copy holds a few objects for the garbage collector to walk, not
    four per (layer, group); ranks and the layers the adapter leaves out are as built."""
    import gc

    cfg, dirs = family
    w = build(cfg, dirs["some_layers"], torch.float32, TPGroup.single(), fast=True)
    assert set(w.groups) == {(layer, g) for layer in (0, 2, 5)
                             for g in ("qkv", "o", "gate_up", "down")}
    for (layer, group), g in w.groups.items():
        a, b = w.stacked[group]
        assert g.a.data_ptr() == a[layer].data_ptr() and g.b.data_ptr() == b[layer].data_ptr()
        assert w.rank_of((layer, group)) == g.rank == 4
    assert w.rank_of((1, "qkv")) == 0 and not w.use_dora
    mixed = build(cfg, dirs["layer_rank"], torch.float32, TPGroup.single(), fast=True)
    assert mixed.rank_of((3, "qkv")) == 8 and mixed.rank_of((4, "qkv")) == 4
    weights = build(cfg, dirs["uniform"], torch.float32, TPGroup.single(), fast=True)
    gc.collect()  # tuples of ints leave the collector's lists at its first look
    assert len(weights.groups) == 48 and len(_tracked_from(weights)) < 48


def _tracked_from(obj) -> dict:
    """The objects the collector tracks that `obj` reaches (its host buffer aside)."""
    import gc

    seen, todo = {}, [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen or not gc.is_tracked(o) or isinstance(o, type) or \
                type(o).__name__ in ("module", "function", "HostBuffer"):
            continue
        seen[id(o)] = o
        todo.extend(gc.get_referents(o))
    return seen
