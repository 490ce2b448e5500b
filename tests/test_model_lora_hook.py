"""Where the model calls `lora.apply`, checked against transformers with the LoRA deltas
merged into its weights (W + B·A), on one rank and across two tensor-parallel ranks
(gloo on the CPU), including a model whose KV heads are replicated across ranks, Qwen3
and Mistral with a sliding window shorter than the prompt.

The test LoRA below implements the documented contract of loramux_core/model/lora_targets.py
directly from full PEFT-shaped factors; the engine's own LoRA pool is tested elsewhere.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from loramux_core.model import lora_targets
from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.parallel import TPGroup
from loramux_kernels.elementwise_ref import add_rms_norm_ref, rms_norm_ref, silu_mul_ref
from tests.support.tiny import TinySpec, load_hf_model, make_model

RANK_R = 4
PROMPT = [0, 17, 33, 99, 200, 7, 250, 9, 120, 11]
SPECS = {"gqa": TinySpec(seed=7), "one_kv_head": TinySpec(num_kv_heads=1, arch="qwen2", seed=8),
         "qwen3": TinySpec(arch="qwen3", seed=9),  # q/k norms over heads split across ranks
         "mistral_window": TinySpec(arch="mistral", sliding_window=4, seed=10)}


def lora_factors(cfg, seed: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Full (A [r, in], B [out, r]) per module and layer, keyed 'layer.module'."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(cfg.num_layers):
        for module in (t.module for t in lora_targets.decoder_targets(cfg)):
            fin, fout = lora_targets.full_shape(cfg, module)
            out[f"{layer}.{module}"] = (torch.randn(RANK_R, fin, generator=gen) * 0.1,
                                        torch.randn(fout, RANK_R, generator=gen) * 0.1)
    return out


class MergedDeltaLora:
    """One adapter for every token; cuts its factors per rank as lora_shard says."""

    def __init__(self, cfg, factors, tp: TPGroup):
        self.cfg, self.factors, self.tp = cfg, factors, tp
        self.shapes = lora_targets.lora_group_shapes(cfg, tp.size)
        self.calls: list[tuple[int, str]] = []

    def apply_embedding(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """No LoRA on embed_tokens here (loramux_core/model/lora_targets.py END_TARGETS)."""

    def add_norm(self, layer_idx, group, x, residual, weight, eps):
        """The norm before a group, as the model would run it alone."""
        self.calls.append((layer_idx, f"norm before {group}"))
        if x is None:
            return rms_norm_ref(residual, weight, eps), residual
        return add_rms_norm_ref(x, residual, weight, eps)

    def act(self, layer_idx, group, gate_up):
        """The activation before a group, as the model would run it alone."""
        self.calls.append((layer_idx, f"act before {group}"))
        return silu_mul_ref(gate_up)

    def finish(self):
        """Nothing is left for after the last layer here."""

    def matmul(self, layer_idx, group, linear, x):
        """The group's base matmul, as the model would run it alone."""
        return linear.matmul(x)

    def apply(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.calls.append((layer_idx, group))
        assert x.shape[1] == self.shapes[group].in_features
        assert y.shape[1] == sum(self.shapes[group].out_features)
        for t in lora_targets.decoder_targets(self.cfg):
            if t.group != group:
                continue
            module, idx = t.module, t.slice
            a, b = self.factors[f"{layer_idx}.{module}"]
            cut = lora_targets.lora_shard(self.cfg, module, self.tp.rank, self.tp.size)
            s = cut.shard
            if cut.factor == "B":
                b = b[s.start:s.stop]
            else:
                a = a[:, s.start:s.stop]
            off = sum(self.shapes[group].out_features[:idx])
            y[:, off:off + b.shape[0]] += x @ a.T @ b.T


def merged_hf_logits(path, factors, ids):
    hf = load_hf_model(path)
    with torch.no_grad():
        for key, (a, b) in factors.items():
            layer, module = key.split(".")
            block = hf.model.layers[int(layer)]
            parent = block.mlp if module in ("gate_proj", "up_proj", "down_proj") else block.self_attn
            getattr(parent, module).weight += b @ a
        return hf(torch.tensor([ids])).logits[0]


def run_prompt_and_decode(model, lora, tokens):
    """Prefill all but the last token, then decode the last: logits of every position."""
    kv = model.make_kv_caches(8, 4)
    table = [5, 2, 7]
    out = []
    for done, new in ((0, len(tokens) - 1), (len(tokens) - 1, 1)):
        attn = make_attention_metadata([table], [done], [new], 4)
        h = model(torch.tensor(tokens[done:done + new]), attn, kv, lora=lora)
        out.append(model.compute_logits(h))
    return torch.cat(out)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_hook")
    return {name: make_model(root / name, spec) for name, spec in SPECS.items()}


@pytest.mark.parametrize("name", list(SPECS))
def test_lora_hook_single_rank(dirs, name):
    path = dirs[name]
    cfg = ModelConfig.from_dir(path)
    model = LlamaForCausalLM(cfg)
    model.load_weights(path)
    factors = lora_factors(cfg, seed=3)
    lora = MergedDeltaLora(cfg, factors, TPGroup.single())
    ours = run_prompt_and_decode(model, lora, PROMPT)
    ref = merged_hf_logits(path, factors, PROMPT)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # the deltas are large enough that skipping any call would fail the comparison
    base = run_prompt_and_decode(model, None, PROMPT)
    assert (base - ref).abs().max() > 0.05
    per_step = [(i, g) for i in range(cfg.num_layers)
                for g in ("norm before qkv", "qkv", "o", "norm before gate_up", "gate_up",
                          "act before down", "down")]
    assert lora.calls == per_step * 2


def _tp_worker(rank: int, size: int, rdv: str, paths: list[str], out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=size)
    tp = TPGroup(rank, size, None)
    results = {}
    for i, path in enumerate(paths):
        cfg = ModelConfig.from_dir(path)
        model = LlamaForCausalLM(cfg, tp=tp)
        model.load_weights(path)
        lora = MergedDeltaLora(cfg, lora_factors(cfg, seed=3), tp)
        results[f"base{i}"] = run_prompt_and_decode(model, None, PROMPT)
        results[f"lora{i}"] = run_prompt_and_decode(model, lora, PROMPT)
    save_file({k: v.contiguous() for k, v in results.items()}, f"{out_dir}/rank{rank}.safetensors")
    dist.destroy_process_group()


def test_tensor_parallel_two_ranks(dirs, tmp_path):
    paths = [str(dirs[name]) for name in SPECS]
    mp.spawn(_tp_worker, args=(2, str(tmp_path / "rdv"), paths, str(tmp_path)), nprocs=2)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    for i, path in enumerate(paths):
        cfg = ModelConfig.from_dir(path)
        hf = load_hf_model(path)
        with torch.no_grad():
            base_ref = hf(torch.tensor([PROMPT])).logits[0]
        lora_ref = merged_hf_logits(path, lora_factors(cfg, seed=3), PROMPT)
        for r in range(2):
            torch.testing.assert_close(ranks[r][f"base{i}"], base_ref, atol=1e-4, rtol=0)
            torch.testing.assert_close(ranks[r][f"lora{i}"], lora_ref, atol=1e-4, rtol=0)
