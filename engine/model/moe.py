"""The mixture-of-experts MLP of a decoder layer (Qwen2-MoE), tensor-parallel.

    router      logits = x · Wgᵀ (replicated), softmax in float32, top k (kernels/moe.py)
    experts     Σ_j weight_j · down_e(silu(gate_e(x)) · up_e(x)) over the k chosen experts
    shared      sigmoid(x · gᵀ) · shared_expert(x)  (a dense MLP, when the model has one)

Each rank holds every expert's slice of the experts' intermediate dim (gate and up rows
cut like the dense MLP's gate/up, down's columns likewise), so the routed sum and the
shared expert are partial sums that one all-reduce completes; the router and the shared
gate are replicated. Weights load from the per-expert tensors of the checkpoint
(`{prefix}.experts.{e}.{module}.weight`, the modules the architecture's expert targets
name).

LoRA: the shared expert is the layer's dense MLP for `lora.apply` ("gate_up", "down");
the experts' own LoRA comes from `lora.expert_lora(layer_idx)` (loramux_core/model/lora_targets.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loramux_core.model import sharding
from loramux_core.model.archs import architecture
from loramux_engine.model.layers import _param, check_shape
from loramux_engine.model.loader import WeightSource
from loramux_engine.parallel import TPGroup
from loramux_kernels.moe import fused_moe, route


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg, layer_idx: int, tp: TPGroup, dtype, device, shared_mlp):
        super().__init__()
        moe = cfg.moe
        self.layer_idx, self.tp, self.moe = layer_idx, tp, moe
        self.hidden = cfg.hidden_size
        self.cut = sharding.even_shard(moe.intermediate_size, tp.rank, tp.size)
        E, inter = moe.num_experts, self.cut.length
        self.gate = _param((E, cfg.hidden_size), dtype, device)
        self.w13 = _param((E, 2 * inter, cfg.hidden_size), dtype, device)
        self.w2 = _param((E, cfg.hidden_size, inter), dtype, device)
        self.shared_expert = shared_mlp
        self._targets = architecture(cfg).expert_targets   # the fused parameters, declared
        self.shared_expert_gate = (_param((1, cfg.hidden_size), dtype, device)
                                   if moe.shared_expert else None)

    def forward(self, x: torch.Tensor, lora) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate), self.moe.top_k, self.moe.norm_topk_prob)
        experts = lora.expert_lora(self.layer_idx) if lora is not None else None
        y = fused_moe(x, self.w13, self.w2, weights, ids, experts)
        if self.shared_expert is not None:
            gate = torch.sigmoid(F.linear(x, self.shared_expert_gate))
            y = y + gate * self.shared_expert.partial(x, lora)
        return self.tp.all_reduce(y)

    def loaders(self, prefix: str) -> dict:
        out = {f"{prefix}.gate.weight": self._load_router}
        for t in self._targets:   # per expert, the modules each fused parameter stacks
            load = self._load_gate_up if t.parallel == "column" else self._load_down
            for e in range(self.moe.num_experts):
                for half, module in enumerate(t.modules):
                    out[f"{prefix}.experts.{e}.{module}.weight"] = _expert(load, e, half)
        if self.shared_expert is not None:
            out.update(self.shared_expert.loaders(f"{prefix}.shared_expert"))
            out[f"{prefix}.shared_expert_gate.weight"] = self._load_shared_gate
        return out

    def _load_router(self, src: WeightSource, name: str) -> None:
        check_shape(src, name, tuple(self.gate.shape))
        self.gate.data.copy_(src.read(name, dtype=self.gate.dtype))

    def _load_shared_gate(self, src: WeightSource, name: str) -> None:
        check_shape(src, name, (1, self.hidden))
        self.shared_expert_gate.data.copy_(src.read(name, dtype=self.gate.dtype))

    def _load_gate_up(self, src: WeightSource, name: str, e: int, half: int) -> None:
        check_shape(src, name, (self.moe.intermediate_size, self.hidden))
        n = self.cut.length
        self.w13.data[e, half * n:(half + 1) * n] = src.read(name, rows=self.cut,
                                                             dtype=self.w13.dtype)

    def _load_down(self, src: WeightSource, name: str, e: int, _: int) -> None:
        check_shape(src, name, (self.hidden, self.moe.intermediate_size))
        self.w2.data[e] = src.read(name, cols=self.cut, dtype=self.w2.dtype)


def _expert(load, e: int, half: int):
    return lambda src, name: load(src, name, e, half)
