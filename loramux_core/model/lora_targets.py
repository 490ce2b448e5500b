"""Where LoRA deltas enter the base model: the contract between the model and the LoRA pool.

Each architecture declares its targets in its own module (loramux_core/model/archs/): the HF
modules LoRA may wrap, their (in, out) dims, their tensor-parallel split and the merged
group and slice each sits in. Everything here (shapes per rank, which factor a rank
cuts, the groups) is computed from that declaration, and the LoRA pool, loader, planner
and sharding ask here, so adding a target or an architecture is one file.

The Llama-family model runs four merged projection groups per decoder layer and, when
given a LoRA object, calls `lora.apply(layer_idx, group, x, y)` once per group; `apply`
must add the delta of every adapter in the batch into `y` in place.

    group     HF modules (slice index)         parallel   x given to apply           y given to apply
    "qkv"     q_proj 0, k_proj 1, v_proj 2      column     normed hidden [T, hidden]   merged q|k|v output, before bias
    "o"       o_proj 0                          row        attention out [T, H_r*D]    local partial, before all-reduce
    "gate_up" gate_proj 0, up_proj 1            column     normed hidden [T, hidden]   merged gate|up output
    "down"    down_proj 0                       row        act(gate)*up [T, I/tp]      local partial, before all-reduce

The norm before "qkv" (and before "gate_up" in a dense MLP) is asked of the LoRA object
too: `lora.add_norm(layer_idx, group, x, residual, weight, eps)` must return
(rms_norm(residual + x) with that weight, residual + x), x None: (rms_norm(residual),
residual); the engine's pool may start the group's LoRA shrink in the same launch. So is
the MLP's activation before "down": `lora.act(layer_idx, "down", gate_up)` must return
silu(gate) * up of gate_up = [gate | up].

The ends: the model also calls `lora.apply_embedding(input_ids, h)` on the embedding's
output, and `compute_logits(hidden, lora, rows)` calls `lora.apply_head(rows, hidden,
logits)` (END_TARGETS below).

The slices of a merged column-parallel output are laid side by side along the last dim
of y, in slice order, with the per-rank widths of `lora_group_shapes(...)[group].out_features`.

Tensor parallelism (see loramux_core/model/sharding.py): for a column-parallel module, A is
replicated and B is cut by output rows exactly like the base weight; for a row-parallel
module, A is cut by input columns and B is replicated. Because the row-parallel delta is
added to the partial product before the all-reduce, the reduction also sums the LoRA term.
`lora_shard` says which factor each rank cuts and where.

Mixture-of-experts layers (engine/model/moe.py) take LoRA on their fused expert weights
as PEFT's `target_parameters` expresses it (loramux_core/model/archs/qwen2_moe.py): per layer and
parameter, with E experts and rank r, PEFT stores lora_A [E·r, in] (expert-major rows)
and lora_B [out, r·E] (column j·E + e is rank j of expert e). The pool keeps, scaling
folded in, a [E, r, in_rank] and b [E, out_rank, r] per slot (`expert_factors`), and
the model asks the LoRA object for them with `lora.expert_lora(layer_idx)` (kernels/moe.py
ExpertLoRA). Under tensor parallelism the experts' intermediate dim is split like the
dense MLP's: gate_up_proj is column-parallel (B's gate rows and up rows each cut, A
whole), down_proj row-parallel (A's columns cut, B whole).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from loramux_core.model import sharding
from loramux_core.model.archs import architecture
from loramux_core.model.archs.base import ExpertTarget, LoraTarget
from loramux_core.model.sharding import Shard



def expert_target(cfg, param: str) -> ExpertTarget:
    """The declaration of one fused expert parameter (KeyError when it is not a target)."""
    for t in architecture(cfg).expert_targets:
        if t.param == param:
            return t
    raise KeyError(f"not a LoRA target parameter: {param!r}")


def expert_roles(cfg) -> tuple[str, str]:
    """(the column-parallel gate|up parameter, the row-parallel down parameter) of the
    experts, as declared: what the expert LoRA kernel (kernels/moe.py) takes them as."""
    by = {t.parallel: t.param for t in architecture(cfg).expert_targets}
    return by["column"], by["row"]


def _expert_width(cfg, dim: str) -> int:
    return {"hidden": cfg.hidden_size, "expert_inter": cfg.moe.intermediate_size}[dim]


def expert_full_shape(cfg, param: str) -> tuple[int, int]:
    """(in_features, out_features) of one expert's matrix of a fused parameter."""
    t = expert_target(cfg, param)
    return _expert_width(cfg, t.dims[0]), t.slices * _expert_width(cfg, t.dims[1])


def expert_shard_shape(cfg, param: str, tp_size: int) -> tuple[int, int]:
    """(in_features, out_features) of one expert's matrix on one rank."""
    k, n = expert_full_shape(cfg, param)
    column = expert_target(cfg, param).parallel == "column"
    return (k, n // tp_size) if column else (k // tp_size, n)


def expert_factors(cfg, param: str, lora_a, lora_b, rank: int, tp_rank: int, tp_size: int):
    """This rank's (a [E, r, in], b [E, out, r]) from PEFT's lora_A [E·r, in] and
    lora_B [out, r·E] (views or copies; scaling not applied)."""
    E = cfg.moe.num_experts
    a = lora_a.reshape(E, rank, lora_a.shape[1])
    b = lora_b.reshape(lora_b.shape[0], rank, E).permute(2, 0, 1)
    inter = cfg.moe.intermediate_size
    cut = sharding.even_shard(inter, tp_rank, tp_size)
    if tp_size == 1:
        return a, b
    t = expert_target(cfg, param)
    if t.parallel == "column":   # each slice's rows cut (gate rows, then up rows)
        rows = [i for s in range(t.slices) for i in range(s * inter + cut.start,
                                                           s * inter + cut.stop)]
        return a, b[:, rows, :]
    return a[:, :, cut.start:cut.stop], b


# LoRA on the model's two ends, outside the decoder layers, by HF module name (as PEFT
# names the module). Per adapter slot the pool keeps, with the scaling folded into B:
#   "lm_head":      A [R, hidden], B [vocab, R]; logits += (x A^T) B^T
#   "embed_tokens": A [R, vocab],  B [hidden, R]; h += A[:, id]^T B^T   (PEFT's
#                   lora_embedding_A / lora_embedding_B)
# Tied embeddings share the base weight only: each end's LoRA delta is its own.
END_TARGETS = MappingProxyType({"lm_head": "lm_head", "embed_tokens": "model.embed_tokens"})
END_GROUP = -1   # the `layer` of an end target in (layer, module) keys



def decoder_targets(cfg) -> tuple[LoraTarget, ...]:
    """The decoder modules LoRA may wrap, as the model's architecture declares them."""
    return architecture(cfg).lora_targets


def target(cfg, module: str) -> LoraTarget:
    """The declaration of one decoder module (KeyError when it is not a target)."""
    for t in architecture(cfg).lora_targets:
        if t.module == module:
            return t
    raise KeyError(f"not a LoRA target module: {module!r}")


def group_targets(cfg, group: str) -> tuple[LoraTarget, ...]:
    """The declared modules of one group, in slice order (the model names their weights
    `model.layers.{i}.{parent}.{module}.weight` after them)."""
    return tuple(sorted((t for t in architecture(cfg).lora_targets if t.group == group),
                        key=lambda t: t.slice))


def groups(cfg) -> tuple[str, ...]:
    """The merged projection groups of a decoder layer, in declaration order."""
    return tuple(dict.fromkeys(t.group for t in architecture(cfg).lora_targets))


def row_parallel_groups(cfg) -> frozenset[str]:
    """The groups whose base weight is split by input columns under tensor parallelism."""
    return frozenset(t.group for t in architecture(cfg).lora_targets if t.parallel == "row")


def _width(cfg, dim: str) -> int:
    return {"hidden": cfg.hidden_size, "q": cfg.num_heads * cfg.head_dim,
            "kv": cfg.num_kv_heads * cfg.head_dim, "inter": cfg.intermediate_size}[dim]


def _shard_of(cfg, dim: str, rank: int, size: int) -> Shard:
    """This rank's part of a sharded dimension (never "hidden": it is not split)."""
    if dim == "q":
        return sharding.rows(sharding.q_heads(cfg, rank, size), cfg.head_dim)
    if dim == "kv":
        return sharding.rows(sharding.kv_heads(cfg, rank, size), cfg.head_dim)
    assert dim == "inter", dim
    return sharding.even_shard(cfg.intermediate_size, rank, size)


class GroupShape(NamedTuple):
    """Per-rank widths of one group: x has `in_features` columns; y's slices have
    `out_features[i]` columns each, side by side."""
    in_features: int
    out_features: tuple[int, ...]


@dataclass(frozen=True)
class LoraShard:
    """How one rank cuts one module's LoRA weights from the full PEFT tensors
    (lora_A: [r, in_full], lora_B: [out_full, r]).

    factor "B": take lora_B[shard.start:shard.stop, :] (column-parallel; A whole).
    factor "A": take lora_A[:, shard.start:shard.stop] (row-parallel; B whole)."""
    factor: str
    shard: Shard


def full_shape(cfg, module: str) -> tuple[int, int]:
    """(in_features, out_features) of the unsharded HF module."""
    if module == "lm_head":
        return cfg.hidden_size, cfg.vocab_size
    if module == "embed_tokens":
        return cfg.vocab_size, cfg.hidden_size
    k_in, n_out = target(cfg, module).dims
    return _width(cfg, k_in), _width(cfg, n_out)


def lora_shard(cfg, module: str, rank: int, size: int) -> LoraShard:
    """The part of `module`'s LoRA weights that rank `rank` of `size` holds."""
    t = target(cfg, module)
    if t.parallel == "column":
        return LoraShard("B", _shard_of(cfg, t.dims[1], rank, size))
    return LoraShard("A", _shard_of(cfg, t.dims[0], rank, size))


def lora_group_shapes(cfg, tp_size: int = 1) -> dict[str, GroupShape]:
    """Per-rank in/out widths of every group (identical on every rank)."""
    def width(dim: str, split: bool) -> int:
        return _shard_of(cfg, dim, 0, tp_size).length if split else _width(cfg, dim)

    out: dict[str, list] = {}
    for t in architecture(cfg).lora_targets:
        k_in, n_out = t.dims
        k = width(k_in, t.parallel == "row")
        entry = out.setdefault(t.group, [k, []])
        entry[1].append(width(n_out, t.parallel == "column"))
    return {g: GroupShape(k, tuple(ns)) for g, (k, ns) in out.items()}
