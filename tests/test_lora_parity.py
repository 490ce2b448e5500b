"""LoRA deltas from load_lora + LoRASlotPool + LoRABatch against PEFT's own modules.

Oracle: for every wrapped module of every layer, PEFT's module output minus its base
layer's output, float32 on the CPU. Several adapters sit in different slots of one pool
and one batch mixes their tokens with base-model tokens (slot -1).
"""
from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from loramux_engine.lora import LoRABatch, LoRASlotPool, load_lora
from loramux_core.model.hf_config import ModelConfig
from loramux_core.model.archs.llama import DECODER_TARGETS
from loramux_core.model.lora_targets import full_shape, lora_group_shapes, lora_shard
from loramux_engine.parallel import TPGroup
from tests.support.kernel_path import count_fused_shrinks
from tests.support.tiny import (AdapterSpec, load_hf_model, make_adapter, make_model, read_json,
                                write_json)

# the tiny model is a Llama: its declared targets, by module and by group
LORA_TARGETS = {t.module: (t.group, t.slice) for t in DECODER_TARGETS}
GROUPS = tuple(dict.fromkeys(t.group for t in DECODER_TARGETS))

MAX_RANK = 32
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
# name -> (spec, peft overrides, config edit applied after PEFT wrote the adapter)
ADAPTERS = {
    "r4": (AdapterSpec(r=4, lora_alpha=8, seed=1), {}, None),
    "r8_rslora": (AdapterSpec(r=8, lora_alpha=16, use_rslora=True, seed=2), {}, None),
    "r32": (AdapterSpec(r=32, lora_alpha=16, seed=3, std=0.05), {}, None),
    "patterns": (AdapterSpec(r=8, seed=4,
                             rank_pattern={"q_proj": 16, r"layers\.1\.mlp\.down_proj": 2},
                             alpha_pattern={"v_proj": 64, r"model\.layers\.0\.self_attn\.o_proj": 3}),
                 {}, None),
    "attn_only": (AdapterSpec(r=8, target_modules=ATTN, seed=5), {}, None),
    "mlp_only": (AdapterSpec(r=16, lora_alpha=8, target_modules=MLP, seed=6), {}, None),
    "layer1_only": (AdapterSpec(r=4, seed=7), {"layers_to_transform": [1]}, None),
    "regex": (AdapterSpec(r=4, target_modules=("q_proj", "v_proj", "down_proj"), seed=8), {},
              {"target_modules": r".*\.(q_proj|v_proj|down_proj)"}),
    "all_linear": (AdapterSpec(r=4, seed=9), {}, {"target_modules": "all-linear"}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_parity")
    model_dir = make_model(root / "model")
    cfg = ModelConfig.from_dir(model_dir)
    dirs, peft_models = {}, {}
    for name, (spec, overrides, edit) in ADAPTERS.items():
        d = make_adapter(root / name, model_dir, spec, **overrides)
        if edit:
            write_json(d / "adapter_config.json", {**read_json(d / "adapter_config.json"), **edit})
        dirs[name] = d
        peft_models[name] = PeftModel.from_pretrained(load_hf_model(model_dir), d).eval()
    return cfg, dirs, peft_models


def peft_module(peft_model, layer: int, module: str):
    blk = peft_model.base_model.model.model.layers[layer]
    return getattr(blk.self_attn if module in ATTN else blk.mlp, module)


@torch.no_grad()
def peft_delta(peft_model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's LoRA contribution of one module: wrapped output minus base output."""
    mod = peft_module(peft_model, layer, module)
    if not hasattr(mod, "base_layer"):  # not wrapped by this adapter
        return torch.zeros(x.shape[0], mod.out_features, dtype=x.dtype)
    return mod(x) - mod.base_layer(x)


def group_modules(group: str) -> list[str]:
    return [m for m, (g, _) in sorted(LORA_TARGETS.items(), key=lambda kv: kv[1][1]) if g == group]


def expected_group_delta(peft_models, names, token_slots, layer, group, x):
    """[T, N] reference delta for a full (unsharded) group; tokens pick their adapter."""
    per_adapter = torch.stack([
        torch.cat([peft_delta(peft_models[n], layer, m, x) for m in group_modules(group)], dim=1)
        for n in names])                                          # [L, T, N]
    idx = token_slots.clamp(min=0)
    out = per_adapter[idx, torch.arange(x.shape[0])]
    return out * (token_slots >= 0).unsqueeze(1).float()


def run_group(batch, layer, group, x, n_out, gen):
    y0 = torch.randn(x.shape[0], n_out, generator=gen).to(x.device)
    y = y0.clone()
    batch.apply(layer, group, x, y)
    return y - y0


def test_targets_match_peft(setup):
    cfg, dirs, peft_models = setup
    for name, d in dirs.items():
        w = load_lora(d, cfg, MAX_RANK)
        for layer in range(cfg.num_layers):
            for module, (group, s) in LORA_TARGETS.items():
                wrapped = hasattr(peft_module(peft_models[name], layer, module), "base_layer")
                gw = w.groups.get((layer, group))
                ours = gw is not None and gw.slice_ranks[s] > 0
                assert ours == wrapped, (name, layer, module)
                if wrapped:
                    peft_r = peft_module(peft_models[name], layer, module).r["default"]
                    assert gw.slice_ranks[s] == peft_r, (name, layer, module)


def _loaded_pool(cfg, dirs, names, device: str) -> LoRASlotPool:
    """A slot pool with the adapters `names` in slots 0, 1, ... (pinned host copies on
    CUDA, as the engine loads them)."""
    pool = LoRASlotPool(cfg, max_loras=len(names), max_lora_rank=MAX_RANK, device=device)
    for slot, name in enumerate(names):
        w = load_lora(dirs[name], cfg, MAX_RANK)
        pool.load(slot, w.pin_memory() if device == "cuda" else w)
    return pool


def _check_every_group(cfg, pool, peft_models, names, token_slots, device, gen, tol) -> None:
    """Every layer group's LoRA delta for a batch mapped by `token_slots` (-1: base row)
    equals PEFT's on fresh random inputs; base rows get exactly nothing."""
    T = token_slots.shape[0]
    batch = LoRABatch(pool, token_slots.to(device))
    shapes = lora_group_shapes(cfg)
    for layer in range(cfg.num_layers):
        for group in GROUPS:
            x = torch.randn(T, shapes[group].in_features, generator=gen)
            got = run_group(batch, layer, group, x.to(device),
                            sum(shapes[group].out_features), gen).cpu()
            want = expected_group_delta(peft_models, names, token_slots, layer, group, x)
            assert want.abs().max() > 0.1  # the adapters really contribute
            torch.testing.assert_close(got, want, **tol,
                                       msg=lambda m: f"T={T} layer {layer} {group}: {m}")
            assert torch.all(got[token_slots < 0] == 0)


DEVICES = [pytest.param("cpu"),
           pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))]
# The Triton kernels take CPU tensors only in Triton's interpreter, which the suite turns on
# only without a GPU (tests/conftest.py); there the "cuda" cases run the same kernels.
_INTERPRETED = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="Triton on CPU tensors: interpreter only, no GPU")
TRITON_DEVICES = [pytest.param("cpu", marks=_INTERPRETED), DEVICES[1]]


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_batch_matches_peft(setup, device):
    """On CUDA: pool on the device, pinned host copies, the Triton kernel via loramux_kernels.lora."""
    cfg, dirs, peft_models = setup
    names = list(dirs)
    pool = _loaded_pool(cfg, dirs, names, device)
    gen = torch.Generator().manual_seed(0)
    tol = dict(rtol=1e-5, atol=1e-5) if device == "cpu" else dict(rtol=1e-4, atol=1e-4)
    for T in (40, 7):  # a prefill-sized and a decode-sized batch
        token_slots = torch.randint(-1, len(names), (T,), generator=gen)
        token_slots[: min(T, len(names) + 1)] = torch.arange(-1, min(T, len(names) + 1) - 1)
        _check_every_group(cfg, pool, peft_models, names, token_slots, device, gen, tol)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=_INTERPRETED),
                                    pytest.param("cuda", marks=_CUDA)])
def test_one_adapter_batch_matches_peft(setup, device, monkeypatch):
    """A batch on one adapter with base rows at its end (a padded decode bucket), given as
    uniform: the token kernels' two launches per group with the launch parameters tuned
    for one adapter; natively on CUDA and under the Triton interpreter on the CPU (in
    place of the CPU's reference)."""
    from loramux_kernels import lora as lora_kernels
    from loramux_kernels.lora import launch
    if device == "cpu":
        monkeypatch.setattr(lora_kernels, "add_lora", launch.add_lora)
    cfg, dirs, peft_models = setup
    names = ["r8_rslora", "patterns", "r32"]
    pool = _loaded_pool(cfg, dirs, names, device)
    gen = torch.Generator().manual_seed(1)
    shapes = lora_group_shapes(cfg)
    for T, slot in ((8, 1), (5, 2)):
        token_slots = torch.full((T,), slot)
        token_slots[-2:] = -1
        batch = LoRABatch(pool, token_slots.to(device), uniform=True)
        for layer in range(cfg.num_layers):
            for group in GROUPS:
                x = torch.randn(T, shapes[group].in_features, generator=gen)
                xd = x.to(device)
                got = run_group(batch, layer, group, xd, sum(shapes[group].out_features),
                                gen).cpu()
                want = expected_group_delta(peft_models, names, token_slots, layer, group, x)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                           msg=lambda m: f"T={T} layer {layer} {group}: {m}")
                assert torch.all(got[token_slots < 0] == 0)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_prefill_batch_matches_peft(setup, device, monkeypatch):
    """A prefill-sized batch (above the token path's limit): runs of 1, 17 and 200 tokens
    and a few of other adapters, base-model rows between them, shuffled. The tile-list
    prefill kernels (kernels/lora/segment.py), natively on CUDA and under the Triton
    interpreter on the CPU (in place of the CPU's reference)."""
    from loramux_kernels import lora as lora_kernels
    from loramux_kernels.lora import launch
    if device == "cpu":
        monkeypatch.setattr(lora_kernels, "add_lora", launch.add_lora)
    cfg, dirs, peft_models = setup
    names = list(dirs)
    pool = _loaded_pool(cfg, dirs, names, device)
    gen = torch.Generator().manual_seed(2)
    runs = [(1, 0), (17, 1), (200, 2), (9, -1), (30, 3), (5, 4), (40, 6), (3, -1), (20, 8)]
    token_slots = torch.cat([torch.full((n,), slot) for n, slot in runs])
    token_slots = token_slots[torch.randperm(token_slots.shape[0], generator=gen)]
    T = token_slots.shape[0]
    assert T > lora_kernels.TOKEN_PATH_MAX_TOKENS
    _check_every_group(cfg, pool, peft_models, names, token_slots, device, gen,
                       dict(rtol=1e-4, atol=1e-4))


def test_reload_higher_rank_slot_leaves_no_stale_weights(setup):
    cfg, dirs, _ = setup
    small, big = load_lora(dirs["r4"], cfg, MAX_RANK), load_lora(dirs["r32"], cfg, MAX_RANK)
    reused = LoRASlotPool(cfg, max_loras=2, max_lora_rank=MAX_RANK)
    reused.load(0, big)
    reused.load(1, big)
    reused.load(0, small)
    fresh = LoRASlotPool(cfg, max_loras=2, max_lora_rank=MAX_RANK)
    fresh.load(0, small)
    fresh.load(1, big)
    for layer in range(cfg.num_layers):
        for group in GROUPS:
            for t_reused, t_fresh in zip(reused.weights(layer, group)[:3],
                                         fresh.weights(layer, group)[:3]):
                assert torch.equal(t_reused, t_fresh), (layer, group)
    # a slot once holding the mlp+attn adapter, reloaded with attention-only: mlp groups empty
    reused.load(0, load_lora(dirs["attn_only"], cfg, MAX_RANK))
    a, b, ranks, _ = reused.weights(0, "gate_up")
    assert ranks[0] == 0 and not a[0].any() and not b[0].any()


def test_clear_slot_adds_nothing(setup):
    cfg, dirs, _ = setup
    pool = LoRASlotPool(cfg, max_loras=2, max_lora_rank=MAX_RANK)
    pool.load(1, load_lora(dirs["r8_rslora"], cfg, MAX_RANK))
    pool.clear(1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, cfg.hidden_size, generator=gen)
    n = sum(lora_group_shapes(cfg)["qkv"].out_features)
    delta = run_group(LoRABatch(pool, torch.tensor([1, 1, -1, 0, 1])), 0, "qkv", x, n, gen)
    assert torch.all(delta == 0)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_tensor_parallel_shards_sum_to_full_delta(setup, tp_size):
    """Each rank's shard delta is the matching part of the full delta (column-parallel),
    or the row-parallel partials sum to it; tp_size=4 replicates the 2 KV heads."""
    cfg, dirs, _ = setup
    names = ["patterns", "r8_rslora"]
    full_pool = LoRASlotPool(cfg, max_loras=2, max_lora_rank=MAX_RANK)
    rank_pools = [LoRASlotPool(cfg, 2, MAX_RANK, tp_size=tp_size) for _ in range(tp_size)]
    for slot, name in enumerate(names):
        full_pool.load(slot, load_lora(dirs[name], cfg, MAX_RANK))
        for r, pool in enumerate(rank_pools):
            pool.load(slot, load_lora(dirs[name], cfg, MAX_RANK, tp=TPGroup(r, tp_size)))
    token_slots = torch.tensor([0, 1, -1, 1, 0, 0])
    gen = torch.Generator().manual_seed(2)
    full_shapes, shard_shapes = lora_group_shapes(cfg), lora_group_shapes(cfg, tp_size)
    for layer in range(cfg.num_layers):
        for group in GROUPS:
            modules = group_modules(group)
            x = torch.randn(len(token_slots), full_shapes[group].in_features, generator=gen)
            full = run_group(LoRABatch(full_pool, token_slots), layer, group, x,
                             sum(full_shapes[group].out_features), gen)
            total = torch.zeros_like(full)
            for r, pool in enumerate(rank_pools):
                cuts = [lora_shard(cfg, m, r, tp_size) for m in modules]
                x_r = x if cuts[0].factor == "B" else x[:, cuts[0].shard.start:cuts[0].shard.stop]
                part = run_group(LoRABatch(pool, token_slots), layer, group, x_r,
                                 sum(shard_shapes[group].out_features), gen)
                if cuts[0].factor == "A":
                    total += part
                    continue
                off_full, off_r = 0, 0
                for m, cut in zip(modules, cuts):
                    width = cut.shard.length
                    lo = off_full + cut.shard.start
                    torch.testing.assert_close(part[:, off_r:off_r + width],
                                               full[:, lo:lo + width], rtol=1e-5, atol=1e-5)
                    off_full += full_shape(cfg, m)[1]
                    off_r += width
            if cuts[0].factor == "A":
                torch.testing.assert_close(total, full, rtol=1e-5, atol=1e-5)


def _count_fused(monkeypatch, device: str) -> list[int]:
    """The fused launches of loramux_kernels.lora.norm_shrink_ahead and silu_shrink_ahead counted;
    on the CPU their Triton forms (interpreted) in place of the dispatcher's None, so the
    fused paths really run there too."""
    from loramux_kernels import lora as lora_kernels
    from loramux_kernels.lora import launch
    return count_fused_shrinks(monkeypatch, launch if device == "cpu" else lora_kernels)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("mode,case", [("uniform", "one_some_base"), ("all", "mixed"),
                                       ("mixed", "mixed"), ("all", "all_base")])
def test_norm_shrink_then_expand_matches_peft(setup, device, mode, case, monkeypatch):
    """FUSED_NORM_SHRINK: the add + RMSNorm before q/k/v and gate/up also shrinks its
    output (kernels/lora/norm_shrink.py), FUSED_SILU_SHRINK: the SiLU-and-multiply
    before down too (kernels/lora/silu_shrink.py); `apply` only expands. The norm's and
    activation's outputs equal the references', the deltas PEFT's on those rows; base
    rows get nothing."""
    from loramux_engine.lora import batch as batch_module
    from loramux_kernels.elementwise_ref import add_rms_norm_ref, rms_norm_ref, silu_mul_ref
    monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", mode)
    monkeypatch.setattr(batch_module, "FUSED_SILU_SHRINK", mode)
    calls = _count_fused(monkeypatch, device)
    cfg, dirs, peft_models = setup
    names = ["r8_rslora", "patterns", "r32"]
    pool = _loaded_pool(cfg, dirs, names, device)
    gen = torch.Generator().manual_seed(4)
    shapes = lora_group_shapes(cfg)
    T = 19                                    # two 16-row blocks
    token_slots = {"one_some_base": torch.where(torch.rand(T, generator=gen) < 0.3, -1, 1),
                   "mixed": torch.randint(-1, len(names), (T,), generator=gen),
                   "all_base": torch.full((T,), -1)}[case]
    batch = LoRABatch(pool, token_slots.to(device), uniform=mode == "uniform")
    for layer in range(cfg.num_layers):
        for group, first in (("qkv", True), ("qkv", False), ("gate_up", False)):
            h = torch.randn(T, cfg.hidden_size, generator=gen)
            res = torch.randn(T, cfg.hidden_size, generator=gen) * 2
            w = 1 + torch.randn(cfg.hidden_size, generator=gen) / 4
            want_x, want_res = (rms_norm_ref(res, w, 1e-5), res) if first else \
                add_rms_norm_ref(h, res, w, 1e-5)
            x, new_res = batch.add_norm(layer, group, None if first else h.to(device),
                                        res.to(device), w.to(device), 1e-5)
            torch.testing.assert_close(x.cpu(), want_x, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(new_res.cpu(), want_res, rtol=1e-5, atol=1e-5)
            got = run_group(batch, layer, group, x, sum(shapes[group].out_features), gen).cpu()
            want = expected_group_delta(peft_models, names, token_slots, layer, group, want_x)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                       msg=lambda m: f"layer {layer} {group}: {m}")
            assert torch.all(got[token_slots < 0] == 0)
        gate_up = torch.randn(T, 2 * shapes["down"].in_features, generator=gen) * 2
        want_x = silu_mul_ref(gate_up)
        x = batch.act(layer, "down", gate_up.to(device))
        torch.testing.assert_close(x.cpu(), want_x, rtol=1e-5, atol=1e-5)
        got = run_group(batch, layer, "down", x, sum(shapes["down"].out_features), gen).cpu()
        want = expected_group_delta(peft_models, names, token_slots, layer, "down", want_x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"layer {layer} down: {m}")
        assert torch.all(got[token_slots < 0] == 0)
    assert calls[0] == 4 * cfg.num_layers
