"""What an architecture module declares: its Hugging Face class name, the ModelConfig
fields that differ between architectures (read from config.json), and its LoRA targets
(module, in/out dims, tensor-parallel split, fused slices) that the LoRA pool, loader,
planner and sharding read (through loramux_core/model/lora_targets.py).

Declarations only: nothing here imports torch, so a process that only parses a model's
config (the control plane, the gateway) can use the registry.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from loramux_core.errors import ModelLoadError


@dataclass(frozen=True)
class LoraTarget:
    """One Hugging Face module LoRA may wrap, as an architecture declares it.

    `parent` is its parent module inside a decoder layer (`model.layers.{i}.{parent}.
    {module}`), `group`/`slice` where its output sits in the merged projection the model
    runs, `parallel` how the base weight is split under tensor parallelism ("column": by
    output rows; "row": by input columns). `dims` names the (in, out) widths as config
    quantities: "hidden", "q" (all query heads), "kv" (all KV heads), "inter"."""
    module: str
    parent: str
    group: str
    slice: int
    parallel: str
    dims: tuple[str, str]


@dataclass(frozen=True)
class ExpertTarget:
    """A fused expert parameter LoRA may wrap (PEFT `target_parameters` entry
    `{parent}.{param}`), in the order the experts module registers its parameters (PEFT
    nests one wrapper per targeted parameter in that order: the saved keys of the i-th of
    n targeted parameters carry n-1-i `.base_layer` segments)."""
    param: str          # e.g. "gate_up_proj" [E, 2·inter, hidden], "down_proj" [E, hidden, inter]
    parent: str         # the experts module inside a decoder layer
    parallel: str       # "column" (split by output rows) or "row" (by input columns)
    # one expert's (in, out) widths as config quantities: "hidden", "expert_inter"; the
    # output is `slices` such widths side by side (gate | up), each cut under TP
    dims: tuple[str, str] = ("hidden", "expert_inter")
    slices: int = 1
    # the per-expert checkpoint modules it stacks, in slice order (`{parent}.{e}.{module}`)
    modules: tuple[str, ...] = ()


@dataclass(frozen=True)
class MoeFields:
    """A mixture-of-experts MLP in every decoder layer (engine/model/moe.py): `num_experts`
    experts of intermediate width `intermediate_size`, `top_k` routed per token (softmax,
    top k, renormalised when `norm_topk_prob`), plus a shared expert of the ModelConfig's
    `intermediate_size` when `shared_expert` (its output gated by sigmoid(x·g))."""
    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    shared_expert: bool


@dataclass(frozen=True)
class ArchFields:
    """The ModelConfig fields an architecture decides from its config.json."""
    qkv_bias: bool = False             # q/k/v projections have biases
    o_bias: bool = False               # o_proj has a bias
    qk_norm: bool = False              # RMSNorm over each query/key head before rotary
    sliding_window: int | None = None  # each token attends to the last `sliding_window` positions
    moe: MoeFields | None = None       # the MLP is a mixture of experts
    intermediate_size: int | None = None  # the dense MLP's width, when not config.json's


@dataclass(frozen=True)
class Architecture:
    """One model family the engine serves, registered by its Hugging Face class name.

    `fields(raw)` reads the family's own config.json fields (raising ModelLoadError for
    values it cannot run exactly); `lora_targets` are the decoder modules LoRA may wrap,
    with their geometry, `end_targets` the ends (lm_head, embed_tokens) it may wrap and
    `expert_targets` the fused expert parameters of a mixture of experts (PEFT's
    `target_parameters`) (loramux_core/model/lora_targets.py). The decoder's weight names follow the
    `model.layers.{i}.{parent}.{module}` layout of the targets' parents; the extra tensors
    a flag adds (qk_norm: `self_attn.q_norm`, `self_attn.k_norm`) are loaded by the model."""
    hf_name: str
    fields: Callable[[dict[str, Any]], ArchFields]
    lora_targets: tuple[LoraTarget, ...]
    end_targets: tuple[str, ...] = ("lm_head", "embed_tokens")
    expert_targets: tuple[ExpertTarget, ...] = ()


def refuse_sliding_window(raw: dict[str, Any]) -> None:
    """For families whose window applies to some layers only (Qwen2, Qwen3): served only
    when it is off or covers every position."""
    window = raw.get("sliding_window")
    if raw.get("use_sliding_window") and window is not None \
            and window < raw.get("max_position_embeddings", 0):
        raise ModelLoadError(f"config.json: use_sliding_window=true with sliding_window={window} "
                             f"is not supported for {raw['architectures'][0]} (full attention only)")
