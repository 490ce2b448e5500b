"""Where LoRA deltas enter the base model: the contract between the model and the LoRA pool.

The model runs four merged projection groups per decoder layer and, when given a LoRA
object, calls `lora.apply(layer_idx, group, x, y)` once per group; `apply` must add the
delta of every adapter in the batch into `y` in place.

    group     HF modules (slice index)         parallel   x given to apply           y given to apply
    "qkv"     q_proj 0, k_proj 1, v_proj 2      column     normed hidden [T, hidden]   merged q|k|v output, before bias
    "o"       o_proj 0                          row        attention out [T, H_r*D]    local partial, before all-reduce
    "gate_up" gate_proj 0, up_proj 1            column     normed hidden [T, hidden]   merged gate|up output
    "down"    down_proj 0                       row        act(gate)*up [T, I/tp]      local partial, before all-reduce

The slices of a merged column-parallel output are laid side by side along the last dim
of y, in slice order, with the per-rank widths of `lora_group_shapes(...)[group].out_features`.

Tensor parallelism (see engine/model/sharding.py): for a column-parallel module, A is
replicated and B is cut by output rows exactly like the base weight; for a row-parallel
module, A is cut by input columns and B is replicated. Because the row-parallel delta is
added to the partial product before the all-reduce, the reduction also sums the LoRA term.
`lora_shard` says which factor each rank cuts and where.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from engine.model import sharding
from engine.model.sharding import Shard

GROUPS: tuple[str, ...] = ("qkv", "o", "gate_up", "down")
ROW_PARALLEL_GROUPS = frozenset({"o", "down"})

# HF module name -> (group, slice index inside the group's merged output)
LORA_TARGETS = MappingProxyType({
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
})


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
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "q_proj": (cfg.hidden_size, q), "k_proj": (cfg.hidden_size, kv),
        "v_proj": (cfg.hidden_size, kv), "o_proj": (q, cfg.hidden_size),
        "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
        "up_proj": (cfg.hidden_size, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    return shapes[module]


def lora_shard(cfg, module: str, rank: int, size: int) -> LoraShard:
    """The part of `module`'s LoRA weights that rank `rank` of `size` holds."""
    d = cfg.head_dim
    if module == "q_proj":
        return LoraShard("B", sharding.rows(sharding.q_heads(cfg, rank, size), d))
    if module in ("k_proj", "v_proj"):
        return LoraShard("B", sharding.rows(sharding.kv_heads(cfg, rank, size), d))
    if module in ("gate_proj", "up_proj"):
        return LoraShard("B", sharding.even_shard(cfg.intermediate_size, rank, size))
    if module == "o_proj":
        return LoraShard("A", sharding.rows(sharding.q_heads(cfg, rank, size), d))
    if module == "down_proj":
        return LoraShard("A", sharding.even_shard(cfg.intermediate_size, rank, size))
    raise KeyError(f"not a LoRA target module: {module!r}")


def lora_group_shapes(cfg, tp_size: int = 1) -> dict[str, GroupShape]:
    """Per-rank in/out widths of every group (identical on every rank)."""
    q = sharding.q_heads(cfg, 0, tp_size).length * cfg.head_dim
    kv = sharding.kv_heads(cfg, 0, tp_size).length * cfg.head_dim
    inter = cfg.intermediate_size // tp_size
    h = cfg.hidden_size
    return {
        "qkv": GroupShape(h, (q, kv, kv)),
        "o": GroupShape(q, (h,)),
        "gate_up": GroupShape(h, (inter, inter)),
        "down": GroupShape(inter, (h,)),
    }
