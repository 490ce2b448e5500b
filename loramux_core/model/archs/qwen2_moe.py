"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2 attention (q/k/v biases via `qkv_bias`) and a
mixture-of-experts MLP in every layer: `num_experts` experts of width
`moe_intermediate_size`, `num_experts_per_tok` routed per token (softmax, top k,
renormalised when `norm_topk_prob`), plus one shared expert of width
`shared_expert_intermediate_size` whose output is gated by sigmoid(x·shared_expert_gate).

LoRA: the attention projections and the shared expert's gate/up/down projections as
modules (PEFT `target_modules`; the shared expert serves as the layer's dense MLP), and
the routed experts' fused weights as parameters (PEFT `target_parameters`
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`). Checkpoints store the experts one
module each (`mlp.experts.{e}.gate_proj.weight`, ...), as transformers writes them.
"""
from dataclasses import replace

from loramux_core.model.archs.base import (Architecture, ArchFields, ExpertTarget, MoeFields,
                                           refuse_sliding_window)
from loramux_core.model.archs.llama import DECODER_TARGETS
from loramux_core.errors import ModelLoadError

_TARGETS = tuple(replace(t, parent="mlp.shared_expert") if t.parent == "mlp" else t
                 for t in DECODER_TARGETS)
EXPERT_TARGETS: tuple[ExpertTarget, ...] = (
    ExpertTarget("gate_up_proj", "mlp.experts", "column", ("hidden", "expert_inter"), slices=2,
                 modules=("gate_proj", "up_proj")),
    ExpertTarget("down_proj", "mlp.experts", "row", ("expert_inter", "hidden"),
                 modules=("down_proj",)),
)


def _positive(raw: dict, name: str) -> int:
    value = raw.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ModelLoadError(f"config.json: {name}={value!r} must be a positive integer")
    return value


def _fields(raw: dict) -> ArchFields:
    refuse_sliding_window(raw)
    if raw.get("mlp_only_layers") or raw.get("decoder_sparse_step", 1) != 1:
        raise ModelLoadError(
            f"config.json: mlp_only_layers={raw.get('mlp_only_layers')!r}, decoder_sparse_step="
            f"{raw.get('decoder_sparse_step')!r}: only models with experts in every layer are "
            f"supported")
    experts, top_k = _positive(raw, "num_experts"), _positive(raw, "num_experts_per_tok")
    if top_k > experts:
        raise ModelLoadError(f"config.json: num_experts_per_tok={top_k} exceeds "
                             f"num_experts={experts}")
    moe = MoeFields(num_experts=experts, top_k=top_k,
                    intermediate_size=_positive(raw, "moe_intermediate_size"),
                    norm_topk_prob=bool(raw.get("norm_topk_prob", False)), shared_expert=True)
    return ArchFields(qkv_bias=bool(raw.get("qkv_bias", True)), moe=moe,
                      intermediate_size=_positive(raw, "shared_expert_intermediate_size"))


ARCH = Architecture("Qwen2MoeForCausalLM", _fields, lora_targets=_TARGETS,
                    expert_targets=EXPERT_TARGETS)
