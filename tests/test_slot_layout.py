"""The slot layout: each group's weights stacked over the layers, in the pool and in an
adapter's host copy, so a slot load is a few large copies whatever the number of layers,
and leaves exactly what the per-layer load would (nothing of a previous occupant)."""
from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
import torch

from loramux_engine.adapters.copier import StreamCopier
from loramux_engine.lora import LoRASlotPool, load_lora
from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_core.model.hf_config import ModelConfig
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

MAX_RANK = 16


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("slot_layout")
    model_dir = make_model(root / "model", TinySpec(num_layers=3))
    dirs = {
        "full": make_adapter(root / "full", model_dir, AdapterSpec(r=8, seed=1)),
        # wraps layer 1 only, q/k at rank 4 and v at rank 12: zeros elsewhere in the stack
        "sparse": make_adapter(root / "sparse", model_dir,
                               AdapterSpec(r=4, rank_pattern={"v_proj": 12}, seed=2,
                                           target_modules=("q_proj", "k_proj", "v_proj")),
                               layers_to_transform=[1]),
        "small": make_adapter(root / "small", model_dir,
                              AdapterSpec(r=2, target_modules=("down_proj",), seed=3)),
    }
    return ModelConfig.from_dir(model_dir), dirs


def per_layer(w):
    """The same weights without the stacked tensors: the pool copies them layer by layer."""
    groups = {k: dataclasses.replace(g, a=g.a.clone(), b=g.b.clone()) for k, g in w.groups.items()}
    return dataclasses.replace(w, groups=MappingProxyType(groups), buffer=None,
                               stacked=MappingProxyType({}))


def slot_contents(pool: LoRASlotPool, slot: int) -> list[torch.Tensor]:
    out = []
    for layer in range(pool.num_layers):
        for group in pool.groups:
            a, b, ranks, _ = pool.weights(layer, group)
            out += [a[slot].cpu(), b[slot].cpu(), ranks[slot].cpu()]
    return out


def poison(pool: LoRASlotPool, slot: int) -> None:
    for layer in range(pool.num_layers):
        for group in pool.groups:
            a, b, _, _ = pool.weights(layer, group)
            a[slot].fill_(float("nan"))
            b[slot].fill_(float("nan"))
    pool.mark_dirty(slot)


def test_host_copy_stacks_each_group_over_the_layers(family):
    cfg, dirs = family
    w = load_lora(dirs["sparse"], cfg, MAX_RANK, buffers=HostBufferPool())
    assert set(w.stacked) == {"qkv"} and set(w.groups) == {(1, "qkv")}
    a, b = w.stacked["qkv"]
    assert a.shape[0] == b.shape[0] == cfg.num_layers and a.shape[2] == 12
    assert torch.equal(w.groups[(1, "qkv")].a, a[1]) and torch.equal(w.groups[(1, "qkv")].b, b[1])
    assert w.groups[(1, "qkv")].a.data_ptr() == a[1].data_ptr()   # views, not copies
    assert w.groups[(1, "qkv")].slice_ranks == (4, 4, 12)
    for layer in (0, 2):
        assert not a[layer].any() and not b[layer].any()
    assert a[1].abs().sum() > 0 and b[1].abs().sum() > 0            # random LoRA B
    assert 0 < w.buffer_bytes <= w.buffer.nbytes


@pytest.mark.parametrize("first,then", [("full", "sparse"), ("sparse", "small"),
                                        ("small", "full"), ("full", "small")])
def test_stacked_load_equals_the_per_layer_load_in_fewer_copies(family, first, then):
    """Over a slot that held another adapter (or NaN), both paths leave the same bytes."""
    cfg, dirs = family
    w = {n: load_lora(dirs[n], cfg, MAX_RANK, buffers=HostBufferPool()) for n in (first, then)}
    stacked, layered = (LoRASlotPool(cfg, 3, MAX_RANK) for _ in range(2))
    for pool, convert in ((stacked, lambda x: x), (layered, per_layer)):
        pool.load(1, convert(w[first]))
        poison(pool, 2)
        pool.load(2, convert(w[first]))
        for slot in (1, 2):
            before = pool.num_copies
            pool.load(slot, convert(w[then]))
            copies = pool.num_copies - before
            if pool is stacked:
                assert copies <= 2 * 2 * len(pool.groups) + 1, copies   # fills included
    for slot in (1, 2):
        got, want = slot_contents(stacked, slot), slot_contents(layered, slot)
        assert all(torch.equal(g, h) for g, h in zip(got, want))
        assert not any(t.isnan().any() for t in got)
    fresh = LoRASlotPool(cfg, 3, MAX_RANK)
    fresh.load(0, w[then])
    assert all(torch.equal(g, h) for g, h in zip(slot_contents(stacked, 1), slot_contents(fresh, 0)))


def test_clear_zeroes_every_group_of_the_slot(family):
    cfg, dirs = family
    pool = LoRASlotPool(cfg, 2, MAX_RANK)
    pool.load(0, load_lora(dirs["full"], cfg, MAX_RANK))
    pool.load(1, load_lora(dirs["sparse"], cfg, MAX_RANK))
    keep = slot_contents(pool, 1)
    pool.clear(0)
    assert not any(t.any() for t in slot_contents(pool, 0))
    assert all(torch.equal(g, h) for g, h in zip(slot_contents(pool, 1), keep))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_staged_loads_on_the_side_stream_land_whole(family):
    """Back-to-back loads through the one staging buffer, each ordered before a read:
    every slot holds exactly its adapter (the staging buffer is not overwritten while a
    previous load still copies out of it)."""
    cfg, dirs = family
    buffers = HostBufferPool(pin=True)
    names = ["full", "sparse", "small", "full", "small", "sparse"]
    w = {n: load_lora(dirs[n], cfg, MAX_RANK, buffers=buffers) for n in set(names)}
    pool = LoRASlotPool(cfg, len(names), MAX_RANK, device="cuda")
    copier = StreamCopier(torch.device("cuda"))
    for slot in range(len(names)):
        poison(pool, slot)
    copier.note_reads(range(len(names)))  # the poison, queued on the compute stream
    handles = [copier.queue(slot, slot, lambda s=slot: pool.load(s, w[names[s]]))
               for slot in range(len(names))]
    for h in handles:
        copier.order_compute_after(h)
    got = [slot_contents(pool, s) for s in range(len(names))]
    for slot, name in enumerate(names):
        ref = LoRASlotPool(cfg, 1, MAX_RANK)
        ref.load(0, per_layer(w[name]))
        assert all(torch.equal(g, h) for g, h in zip(got[slot], slot_contents(ref, 0))), slot
