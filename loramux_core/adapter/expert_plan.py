"""LoRA on the fused expert weights of a mixture of experts, as PEFT saves it
(`target_parameters`, the architecture's `expert_targets`): which parameters an
adapter wraps, and which saved tensors hold their factors.

PEFT wraps each targeted parameter of a layer's experts module in one more ParamWrapper,
in the order the module registers its parameters, so the saved keys say which parameter
they belong to only by their depth: with n parameters targeted, the i-th has n-1-i
`.base_layer` segments (`model.layers.0.mlp.experts.base_layer.lora_A.weight` is
gate_up_proj when both are targeted). Per parameter: lora_A [E·r, in], lora_B [out, r·E].
"""
from __future__ import annotations

import re

from loramux_core.adapter.config import AdapterConfig
from loramux_core.adapter.patterns import dotted_suffixes
from loramux_core.adapter.safetensors_buffer import check_factor
from loramux_core.model.archs import architecture
from loramux_core.model.lora_targets import ExpertTarget, expert_full_shape
from loramux_core.errors import AdapterError

_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>[\w.]+?)"
                  r"(?P<nest>(?:\.base_layer)*)\.lora_(?P<factor>[AB])(?:\.[\w\-]+)?\.weight$")


def param_name(layer: int, target: ExpertTarget) -> str:
    """The parameter's full name, as PEFT matches `target_parameters` against it."""
    return f"model.layers.{layer}.{target.parent}.{target.param}"


def match_key(key: str, model_cfg):
    """(layer, parent, depth, factor) when `key` is a LoRA factor saved on an experts
    module of this architecture, else None."""
    m = _KEY.match(key)
    parents = {t.parent for t in architecture(model_cfg).expert_targets}
    if m is None or m["parent"] not in parents:
        return None
    return int(m["layer"]), m["parent"], m["nest"].count(".base_layer"), m["factor"]


def targeted_parameters(cfg: AdapterConfig, model_cfg) -> list[tuple[int, ExpertTarget]]:
    """(layer, target) pairs PEFT would wrap; refuses entries that match no supported
    parameter of the architecture."""
    if not cfg.target_parameters:
        return []
    targets = architecture(model_cfg).expert_targets
    supported = ", ".join(f"{t.parent}.{t.param}" for t in targets) or "none"
    names = [(i, t, param_name(i, t)) for i in range(model_cfg.num_layers) for t in targets]
    known = set().union(set(), *(dotted_suffixes(name) for _, _, name in names))
    for entry in cfg.target_parameters:
        if entry not in known:
            raise AdapterError(f"target_parameters entry {entry!r} matches no supported "
                               f"parameter of {model_cfg.arch} (supported: {supported})",
                               feature="target_parameters", file=cfg.file)
    return [(i, t) for i, t, name in names if cfg.targets_parameter(name)]


def expert_keys(targets: list[tuple[int, ExpertTarget]], found: dict, file: str) -> dict:
    """{(layer, target): {"A": key, "B": key}} from the saved keys by depth `found`
    ({(layer, parent, depth): {factor: key}}); refuses missing and unplaceable tensors."""
    per_layer: dict[tuple[int, str], list[ExpertTarget]] = {}
    for layer, t in targets:
        per_layer.setdefault((layer, t.parent), []).append(t)
    out, placed = {}, set()
    for (layer, parent), ts in per_layer.items():
        for i, t in enumerate(ts):
            where = (layer, parent, len(ts) - 1 - i)
            keys = found.get(where, {})
            for factor in "AB":
                if factor not in keys:
                    raise AdapterError(
                        f"missing tensor base_model.model.model.layers.{layer}.{parent}"
                        f"{'.base_layer' * where[2]}.lora_{factor}.weight (target_parameters "
                        f"selects {param_name(layer, t)})", feature="missing_tensor", file=file)
            out[(layer, t)] = keys
            placed.add(where)
    extra = sorted(set(found) - placed)
    if extra:
        key = next(iter(found[extra[0]].values()))
        raise AdapterError(f"tensor {key!r} is for an experts parameter target_parameters "
                           f"does not select", feature="tensor", file=file)
    return out


def check_shapes(cfg: AdapterConfig, model_cfg, layer: int, target: ExpertTarget, keys: dict,
                 shapes: dict, file: str) -> int:
    """The parameter's rank after checking its factors' shapes and dtypes."""
    name = param_name(layer, target)
    r, E = cfg.rank_of(name), model_cfg.moe.num_experts
    k_in, n_out = expert_full_shape(model_cfg, target.param)
    for factor, want in (("A", (E * r, k_in)), ("B", (n_out, r * E))):
        check_factor(keys[factor], shapes[keys[factor]], want,
                     f"rank {r}, {E} experts, parameter {name}", file)
    return r
