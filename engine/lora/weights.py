"""A LoRA adapter read into host memory, laid out for the slot pool of one tensor-parallel rank.

Per decoder layer and LoRA group (engine/model/lora_targets.py), with S slices, this
rank's input width K and output widths n_0..n_{S-1} (N = sum):

    a: [S, R, K]   slice s holds lora_A of its module in rows 0..r_s-1 (zero below)
    b: [N, R]      rows off_s..off_s+n_s-1 hold lora_B * scaling of slice s, cols 0..r_s-1

R is the largest rank among the group's slices. Values are checked where they are served:
after the cast to the serving dtype and with the scaling folded in, every element of A
and of B·scaling must be finite and at most MAX_ABS_WEIGHT in magnitude (trained LoRA
factors are of order 1 or below; far larger values, e.g. from a huge lora_alpha, turn
activations into inf/NaN), otherwise AdapterError names the tensor. Tensor parallelism follows DESIGN.md:
column-parallel groups (qkv, gate_up) keep A whole and cut B's rows like the base weight;
row-parallel groups (o, down) cut A's columns and keep B whole, so each rank's partial
delta is summed by the layer's existing all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from engine.errors import AdapterChangedError, AdapterError
from engine.lora.plan import AdapterPlan, ModulePlan, plan_adapter
from engine.lora.safetensors_buffer import tensor
from engine.model.lora_targets import LORA_TARGETS, GroupShape, lora_group_shapes, lora_shard
from engine.parallel import TPGroup

MAX_ABS_WEIGHT = 1e4


@dataclass(frozen=True)
class GroupWeights:
    """One (layer, group) of one adapter on one rank; see the module docstring."""
    a: torch.Tensor                 # [S, R, K]
    b: torch.Tensor                 # [N, R], scaling folded in
    slice_ranks: tuple[int, ...]    # rank of each slice; 0 = slice not wrapped

    @property
    def rank(self) -> int:
        return max(self.slice_ranks)


@dataclass(frozen=True)
class LoRAWeights:
    """A whole adapter for one rank: `groups[(layer, group)]` exists only where the adapter
    wraps at least one slice of that group."""
    groups: MappingProxyType        # (layer, group) -> GroupWeights
    shapes: MappingProxyType        # group -> GroupShape (this rank's widths)
    num_layers: int
    max_rank: int
    target_modules: frozenset[str]  # HF module kinds wrapped in at least one layer
    tp_rank: int
    tp_size: int
    source: str                     # the adapter's weights file, for messages
    version: str = ""               # sha256 of the files it was built from

    @property
    def nbytes(self) -> int:
        return sum(g.a.nbytes + g.b.nbytes for g in self.groups.values())

    def pin_memory(self) -> "LoRAWeights":
        """A copy in page-locked memory, so pool loads can copy asynchronously."""
        pinned = {k: GroupWeights(g.a.pin_memory(), g.b.pin_memory(), g.slice_ranks)
                  for k, g in self.groups.items()}
        return LoRAWeights(MappingProxyType(pinned), self.shapes, self.num_layers,
                           self.max_rank, self.target_modules, self.tp_rank, self.tp_size,
                           self.source, self.version)


def validate_lora(path: str | Path, model_cfg, max_lora_rank: int, roots=None) -> AdapterPlan:
    """Check an adapter directory against the base model without building tensors
    (config, tensor names, shapes; files read and hashed once: plan.version); raises
    AdapterError. Same checks as `load_lora`, except the values, which depend on the
    serving dtype."""
    return plan_adapter(path, model_cfg, max_lora_rank, roots)


def load_lora(path: str | Path, model_cfg, max_lora_rank: int, tp: TPGroup = TPGroup.single(),
              dtype: torch.dtype = torch.float32, roots=None,
              expected_version: str | None = None) -> LoRAWeights:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors; below
    `roots` when given) into this rank's host layout, scaling folded into B. Raises
    AdapterError (feature, file) for anything that is not a plain LoRA fitting the model,
    or when the files' version is not `expected_version`; nothing is kept on error."""
    plan = plan_adapter(path, model_cfg, max_lora_rank, roots)
    if expected_version is not None and plan.version != expected_version:
        raise AdapterChangedError("adapter files changed since this version was validated "
                                  "or loaded; register or load the name again to serve them",
                                  file=str(path))
    return weights_from_plan(plan, model_cfg, tp, dtype)


def weights_from_plan(plan: AdapterPlan, model_cfg, tp: TPGroup = TPGroup.single(),
                      dtype: torch.dtype = torch.float32) -> LoRAWeights:
    """This rank's host layout of a planned adapter, built from the bytes the plan read."""
    shapes = lora_group_shapes(model_cfg, tp.size)
    by_group: dict[tuple[int, str], dict[int, ModulePlan]] = {}
    for mp in plan.modules:
        group, s = LORA_TARGETS[mp.module]
        by_group.setdefault((mp.layer, group), {})[s] = mp
    groups = {}
    for (layer, group), slices in by_group.items():
        groups[(layer, group)] = _group_weights(plan, model_cfg, tp, shapes[group], slices,
                                                dtype)
    return LoRAWeights(MappingProxyType(groups), MappingProxyType(shapes),
                       model_cfg.num_layers, plan.max_rank, plan.target_modules,
                       tp.rank, tp.size, plan.weights_file, plan.version)


def _group_weights(plan: AdapterPlan, model_cfg, tp: TPGroup, shape: GroupShape,
                   slices: dict[int, ModulePlan], dtype: torch.dtype) -> GroupWeights:
    num_slices = len(shape.out_features)
    r = max(mp.rank for mp in slices.values())
    a = torch.zeros(num_slices, r, shape.in_features, dtype=dtype)
    b = torch.zeros(sum(shape.out_features), r, dtype=dtype)
    ranks = [0] * num_slices
    offset = 0
    for s, width in enumerate(shape.out_features):
        mp = slices.get(s)
        if mp is not None:
            a_s, b_s = _shard(plan, model_cfg, tp, mp)
            a[s, :mp.rank] = a_s.to(dtype)
            b[offset:offset + width, :mp.rank] = (b_s.double() * mp.scaling).to(dtype)
            _check_values(a[s, :mp.rank], mp.a_key, "", plan.weights_file)
            _check_values(b[offset:offset + width, :mp.rank], mp.b_key,
                          f" times scaling {mp.scaling:g}", plan.weights_file)
            ranks[s] = mp.rank
        offset += width
    return GroupWeights(a, b, tuple(ranks))


def _shard(plan: AdapterPlan, model_cfg, tp: TPGroup, mp: ModulePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (lora_A, lora_B) of one module: views into the plan's bytes."""
    cut = lora_shard(model_cfg, mp.module, tp.rank, tp.size)
    a = tensor(plan.weights, plan.tensors[mp.a_key])
    b = tensor(plan.weights, plan.tensors[mp.b_key])
    if cut.factor == "B":
        return a, b[cut.shard.start:cut.shard.stop, :]
    return a[:, cut.shard.start:cut.shard.stop], b


def _check_values(t: torch.Tensor, key: str, what: str, file: str) -> None:
    """`t` as served (cast, scaled): finite and within MAX_ABS_WEIGHT."""
    if not torch.isfinite(t).all():
        raise AdapterError(f"tensor {key!r}{what} holds non-finite values (NaN or inf) in "
                           f"{str(t.dtype).removeprefix('torch.')}", feature="non_finite",
                           file=file)
    peak = float(t.abs().max()) if t.numel() else 0.0
    if peak > MAX_ABS_WEIGHT:
        raise AdapterError(f"tensor {key!r}{what} holds values up to {peak:.3g} in magnitude, "
                           f"more than the {MAX_ABS_WEIGHT:g} allowed", feature="magnitude",
                           file=file)
