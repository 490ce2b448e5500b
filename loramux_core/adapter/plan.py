"""Check a PEFT adapter directory against the base model, before any tensor is built.

`plan_adapter` reads adapter_config.json and adapter_model.safetensors once each, through
loramux_core/safe_files.py (inside the adapter roots, no link followed, hashed: the
hash is the adapter's version), decides which modules of which layers the adapter wraps
(PEFT's own matching rules, loramux_core/adapter/config.py), and checks the safetensors header
(loramux_core/adapter/safetensors_buffer.py) so that every such module has exactly its
lora_A/lora_B tensors with the shapes the base model needs. The control plane uses it to
accept or refuse an adapter; `load_lora` builds the weights from the very bytes planned
here, so both paths refuse exactly the same adapters.
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from loramux_core.adapter import expert_plan
from loramux_core.adapter.base_copies import check_copies, copied_end, copies_bytes
from loramux_core.adapter.config import (CONFIG_NAME, AdapterConfig, parse_adapter_config,
                                         read_config_bytes)
from loramux_core.adapter.patterns import dotted_suffixes
from loramux_core.adapter.safetensors_buffer import (MAX_HEADER_BYTES, TensorInfo, check_factor,
                                                     parse_header)
from loramux_core.model.archs import architecture
from loramux_core.model.lora_targets import (END_GROUP, END_TARGETS, LoraTarget, decoder_targets,
                                             expert_full_shape, full_shape)
from loramux_core.errors import AdapterError
from loramux_core.file_digest import (FINGERPRINT_PREFIX, LEGACY, V1, FileRead,
                                       combined_version, file_digest_v1, file_fingerprint)
from loramux_core.safe_files import AdapterDir, AdapterRoots, Alloc, open_adapter_dir

WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# PEFT strips the adapter name when saving; older files may keep it (`lora_A.default.weight`).
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\.(?P<parent>[\w.]+?)\."
                  r"(?P<module>\w+)\.lora_(?P<factor>[AB])(?:\.[\w\-]+)?\.weight$")
# DoRA's magnitude vector (PEFT saves it without `.weight`; some files keep the name/suffix).
_MAGNITUDE_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(?P<layer>\d+)\."
                            r"(?P<parent>[\w.]+?)\.(?P<module>\w+)\.lora_magnitude_vector"
                            r"(?:\.[\w\-]+)?(?:\.weight)?$")
# LoRA on the ends: lm_head (a Linear: lora_A/lora_B) and embed_tokens (an Embedding:
# lora_embedding_A/lora_embedding_B, saved without `.weight`).
_END_KEY = re.compile(r"^(?:base_model\.model\.)?(?:(?P<head>lm_head)\.lora_(?P<factor>[AB])"
                      r"(?:\.[\w\-]+)?\.weight|model\.(?P<embed>embed_tokens)\.lora_embedding_"
                      r"(?P<efactor>[AB])(?:\.[\w\-]+)?)$")
# Tensors of features we refuse, recognised by name: (regex searched in the key, feature, what).
_REFUSED_KEYS = tuple((re.compile(p), f, w) for p, f, w in (
    (r"\.base_layer\.weight$", "save_embedding_layers",
     "a full copy of a base layer (only copies of embed_tokens and lm_head, equal to the "
     "base model's, are served)"),
    (r"lora_embedding_", "embedding", "LoRA on an embedding"),
    (r"embed_tokens", "embedding", "weights for the embedding"),
    (r"lm_head", "lm_head", "weights for the output head"),
    (r"lora_magnitude_vector", "use_dora", "a DoRA magnitude vector"),
    (r"modules_to_save", "modules_to_save", "a fully trained module copy"),
    (r"\.lora_B(\.[\w\-]+)?\.bias$", "lora_bias", "a LoRA bias"),
    (r"\.bias$", "bias", "a trained bias of a base module"),
))


_FACTOR_NAMES = {"A": "lora_A", "B": "lora_B", "M": "DoRA magnitude vector"}
_FACTOR_KEYS = {"A": "lora_A.weight", "B": "lora_B.weight", "M": "lora_magnitude_vector"}


def module_name(layer: int, module: str, model_cfg=None) -> str:
    """The module's name in the Hugging Face model, as PEFT matches it (layer END_GROUP:
    an end target, lm_head or embed_tokens, needs no `model_cfg`); parents as
    `model_cfg`'s architecture declares them."""
    if layer == END_GROUP:
        return END_TARGETS[module]
    return f"model.layers.{layer}.{_lora_targets(model_cfg)[module].parent}.{module}"


def _lora_targets(model_cfg) -> dict[str, LoraTarget]:
    """The model's LoRA targets by HF module name, as its architecture declares them."""
    return {t.module: t for t in decoder_targets(model_cfg)}


@dataclass(frozen=True)
class ModulePlan:
    """One wrapped module: where its tensors are and how PEFT scales it."""
    layer: int
    module: str          # HF name: q_proj, ..., down_proj
    rank: int
    scaling: float
    a_key: str
    b_key: str
    m_key: str | None = None   # DoRA magnitude vector [out_features]; None: plain LoRA
    expert_param: str | None = None  # a fused experts parameter (gate_up_proj, down_proj):
                                     # module is then its `{parent}.{param}` name


@dataclass(frozen=True)
class AdapterPlan:
    """What an adapter directory holds, checked against the base model: the bytes of
    its weights file as read (once), their header, and the adapter's version."""
    config: AdapterConfig
    weights_file: str                       # for messages: the path as the caller gave it
    modules: tuple[ModulePlan, ...]
    weights: bytes | memoryview             # adapter_model.safetensors, whole (its header
                                            # only, for a header-only plan)
    tensors: dict[str, TensorInfo]          # its checked header
    files: tuple[tuple[str, FileRead], ...] = field(repr=False, compare=False, default=())
    # the files' version before their weights are read (file_digest.file_fingerprint)
    fingerprint: str = ""
    # the same as recorded before the fingerprint left out the ctime (still honoured)
    legacy_fingerprint: str = field(default="", repr=False, compare=False)
    # ((end module, key), ...): full copies of base layers PEFT saved beside the end
    # targets' LoRA; their values must be the base model's (loramux_core/adapter/base_copies.py)
    base_copies: tuple[tuple[str, str], ...] = ()

    @cached_property
    def version(self) -> str:
        """The digest over both files (combined_version); waits for the hashing threads.
        Empty for a header-only plan (plan_adapter)."""
        return combined_version(list(self.files)) if self.files else ""

    def has_version(self, version: str) -> bool:
        """`version` names these files: their version, their fingerprint (what an adapter
        registered before being read was recorded under), or a version recorded for the
        same bytes with an earlier digest (chunked sha256, then plain sha256). The
        earlier digests hash the files again, so only a version that is not the current
        one costs them."""
        if version.startswith(FINGERPRINT_PREFIX):
            return version in (self.fingerprint, self.legacy_fingerprint or self.fingerprint)
        if version == self.version:
            return True
        return bool(self.files) and any(version == combined_version(list(self.files), scheme)
                                        for scheme in (V1, LEGACY))

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)

    @property
    def target_modules(self) -> frozenset[str]:
        """The HF module kinds the adapter wraps in at least one layer."""
        return frozenset(m.module for m in self.modules)


def max_weights_bytes(model_cfg, max_lora_rank: int) -> int:
    """The largest adapter_model.safetensors an adapter of this model can need: every
    module of every layer at max_lora_rank (and a DoRA magnitude) in float64, plus room
    for the header."""
    # + 1: a DoRA magnitude vector is one more row of out_features values
    per_layer = sum((max_lora_rank + 1) * sum(full_shape(model_cfg, m)) * 8
                    for m in _lora_targets(model_cfg))
    ends = sum(max_lora_rank * sum(full_shape(model_cfg, m)) * 8
               for m in architecture(model_cfg).end_targets)
    per_layer += sum(max_lora_rank * model_cfg.moe.num_experts
                     * sum(expert_full_shape(model_cfg, t.param)) * 8
                     for t in architecture(model_cfg).expert_targets)
    return model_cfg.num_layers * per_layer + ends + (1 << 20)


class PlanCache:
    """What plan_adapter derived from bytes it has seen before, for one model config and
    max_lora_rank: the targets of a config (by its bytes) and the checked tensors and
    module plans of a config with a safetensors header (by both, and the file's size).
    Adapters of one shape have byte-identical headers, so registering thousands of them
    parses and matches each header once instead of every time. Only what passed every
    check is kept (a refusal is worked out again, with its own file names); thread-safe."""

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make):
        """The entry for `key`, or `make()` kept under it."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = make()
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return value


def plan_adapter(adapter_dir: str | Path, model_cfg, max_lora_rank: int,
                 roots: AdapterRoots | None = None, alloc: Alloc | None = None,
                 header_only: bool = False, cache: PlanCache | None = None) -> AdapterPlan:
    """Read `adapter_dir` (below `roots` when given; the weights file into a buffer from
    `alloc` when given) and check its config, safetensors header and shapes against
    `model_cfg`; raise AdapterError naming the feature and the file on the first problem
    (PathRefused when the path leaves the roots). The version may still be hashing when
    this returns (AdapterPlan.version waits). `header_only`: the weights file is read
    only through its header, nothing is hashed (the plan has no version and no tensor
    bytes): the same refusals, for a caller that lets the engine read and hash. `cache`:
    what earlier calls for this model config and max_lora_rank derived (PlanCache)."""
    with open_adapter_dir(str(adapter_dir), roots) as d:
        config = read_config_bytes(d)
        cfg = parse_adapter_config(config.data, max_lora_rank, f"{d.shown}/{CONFIG_NAME}")
        weights_file = _check_weights_file(d)

        def find_targets():
            params = expert_plan.targeted_parameters(cfg, model_cfg)
            return params, _targeted_modules(cfg, model_cfg, bool(params))
        config_key = bytes(config.data)
        params, targets = (find_targets() if cache is None
                           else cache.get(("targets", config_key), find_targets))
        limit = max_weights_bytes(model_cfg, max_lora_rank) + copies_bytes(
            model_cfg, [m for layer, m in targets if layer == END_GROUP])
        if header_only:
            weights, (data, st) = None, d.read_head_stat(WEIGHTS_NAME, limit, MAX_HEADER_BYTES)
            size = st.st_size
        else:
            weights = d.read(WEIGHTS_NAME, limit, alloc)
            data, size, st = weights.data, len(weights.data), weights.stat
    head = bytes(data[:8 + min(int.from_bytes(data[:8], "little"), MAX_HEADER_BYTES)])

    def check_tensors():
        return _check_tensors(cfg, model_cfg, data, size, weights_file, params, targets)
    shapes, modules, copies = (check_tensors() if cache is None
                               else cache.get(("tensors", config_key, head, size), check_tensors))
    files = () if weights is None else ((CONFIG_NAME, config), (WEIGHTS_NAME, weights))
    # over the config's v1 digest, as fingerprints were recorded before BLAKE3 chunks
    config_v1 = file_digest_v1(config.data)
    return AdapterPlan(cfg, weights_file, modules, data, shapes, files,
                       file_fingerprint(config_v1, head, st),
                       file_fingerprint(config_v1, head, st, legacy=True), copies)


def _check_tensors(cfg: AdapterConfig, model_cfg, data, size: int, weights_file: str,
                   params, targets) -> tuple[dict[str, TensorInfo], tuple[ModulePlan, ...],
                                             tuple[tuple[str, str], ...]]:
    """The checked header of the weights file, the plan of every module it wraps and its
    copies of base layers."""
    shapes = parse_header(data, weights_file, size)
    copies = {copied_end(k): k for k in shapes if copied_end(k) is not None}
    found, found_experts = _index_keys({k: v for k, v in shapes.items()
                                        if k not in copies.values()},
                                       model_cfg, weights_file, cfg.use_dora)
    modules = []
    for layer, module in targets:
        modules.append(_module_plan(cfg, model_cfg, layer, module, found, shapes, weights_file))
    for (layer, t), keys in expert_plan.expert_keys(params, found_experts, weights_file).items():
        r = expert_plan.check_shapes(cfg, model_cfg, layer, t, keys, shapes, weights_file)
        name = expert_plan.param_name(layer, t)
        modules.append(ModulePlan(layer, f"{t.parent}.{t.param}", r, cfg.scaling_of(name),
                                  keys["A"], keys["B"], expert_param=t.param))
    extra = sorted(set(found) - set(targets))
    if extra:
        layer, module = extra[0]
        key = next(iter(found[(layer, module)].values()))
        raise AdapterError(f"tensor {key!r} is for {module_name(layer, module, model_cfg)}, which "
                           f"target_modules does not select", feature="tensor",
                           file=weights_file)
    return shapes, tuple(modules), check_copies(copies, shapes, targets, model_cfg, weights_file)


def _check_weights_file(d: AdapterDir) -> str:
    """The weights file's path for messages; AdapterError when there is none (pickle
    files are named, never opened)."""
    path = f"{d.shown}/{WEIGHTS_NAME}"
    if d.kind(WEIGHTS_NAME) is not None:
        return path
    pickles = [n for n in d.names() if Path(n).suffix in _PICKLE_SUFFIXES]
    if pickles:
        raise AdapterError(f"only pickle weights ({', '.join(pickles)}) found; pickle is never "
                           f"loaded, save the adapter with safe_serialization=True",
                           feature="pickle", file=f"{d.shown}/{pickles[0]}")
    raise AdapterError(f"adapter directory has no {WEIGHTS_NAME}", feature="weights", file=path)


def _targeted_modules(cfg: AdapterConfig, model_cfg,
                      has_parameters: bool = False) -> list[tuple[int, str]]:
    """(layer, module) pairs PEFT would wrap; refuses targets we cannot serve (none at
    all only when the adapter wraps parameters)."""
    n = model_cfg.num_layers
    if cfg.layers_to_transform and max(cfg.layers_to_transform) >= n:
        raise AdapterError(f"layers_to_transform={list(cfg.layers_to_transform)} names a layer "
                           f"beyond the model's {n} layers", feature="layers_to_transform",
                           file=cfg.file)
    supported = [*_lora_targets(model_cfg), *architecture(model_cfg).end_targets]
    all_names = [(i, m, module_name(i, m, model_cfg)) for i in range(n) for m in _lora_targets(model_cfg)]
    all_names += [(END_GROUP, m, module_name(END_GROUP, m))
                  for m in architecture(model_cfg).end_targets]
    if isinstance(cfg.target_modules, tuple):
        known = set().union(*(dotted_suffixes(name) for _, _, name in all_names))
        for t in cfg.target_modules:
            if t not in known:
                raise AdapterError(f"target_modules entry {t!r} matches no supported module "
                                   f"(supported: {', '.join(supported)})",
                                   feature="target_modules", file=cfg.file)
    targets = [(i, m) for i, m, name in all_names if cfg.targets(name)]
    if not targets and not has_parameters:
        raise AdapterError(f"target_modules={_show(cfg.target_modules)} matches no supported "
                           f"module (supported: {', '.join(supported)})",
                           feature="target_modules", file=cfg.file)
    return targets


def _show(targets) -> str:
    return repr(list(targets) if isinstance(targets, tuple) else targets)


def _index_keys(shapes: dict, model_cfg, file: str, use_dora: bool):
    """({(layer, module): {"A": key, "B": key[, "M": key]}}, and for the experts modules
    {(layer, parent, depth): {"A": key, "B": key}} (loramux_core/adapter/expert_plan.py)); refuses
    every key we cannot place ("M": DoRA magnitude, only when the config sets use_dora)."""
    num_layers, supported = model_cfg.num_layers, _lora_targets(model_cfg)
    found: dict[tuple[int, str], dict[str, str]] = {}
    experts: dict[tuple[int, str, int], dict[str, str]] = {}
    for key in shapes:
        expert = expert_plan.match_key(key, model_cfg)
        if expert is not None:
            _check_layer(key, expert[0], num_layers, file)
            _put(experts.setdefault(expert[:3], {}), expert[3], key, "the same parameter", file)
            continue
        end = _END_KEY.match(key)
        if end is not None:
            module = end["head"] or end["embed"]
            slot = found.setdefault((END_GROUP, module), {})
            factor = end["factor"] or end["efactor"]
            if factor in slot:
                raise AdapterError(f"tensors {slot[factor]!r} and {key!r} both hold the "
                                   f"{_FACTOR_NAMES[factor]} of {module}", feature="tensor",
                                   file=file)
            slot[factor] = key
            continue
        m = _MAGNITUDE_KEY.match(key) if use_dora else None
        if m is None:
            for pattern, feature, what in _REFUSED_KEYS:
                if pattern.search(key):
                    raise AdapterError(f"tensor {key!r} is {what}, which is not supported",
                                       feature=feature, file=file)
            m = _KEY.match(key)
        if m is None or m["module"] not in supported \
                or supported[m["module"]].parent != m["parent"]:
            raise AdapterError(f"unexpected tensor {key!r} (not lora_A/lora_B of a supported "
                               f"module)", feature="tensor", file=file)
        layer = int(m["layer"])
        _check_layer(key, layer, num_layers, file)
        _put(found.setdefault((layer, m["module"]), {}), m.groupdict().get("factor") or "M",
             key, "the same module", file)
    return found, experts


def _check_layer(key: str, layer: int, num_layers: int, file: str) -> None:
    if layer >= num_layers:
        raise AdapterError(f"tensor {key!r} is for layer {layer}, but the model has "
                           f"{num_layers} layers", feature="layer_index", file=file)


def _put(slot: dict, factor: str, key: str, what: str, file: str) -> None:
    if factor in slot:
        raise AdapterError(f"tensors {slot[factor]!r} and {key!r} both hold the "
                           f"{_FACTOR_NAMES[factor]} of {what}", feature="tensor", file=file)
    slot[factor] = key


def _module_plan(cfg: AdapterConfig, model_cfg, layer: int, module: str, found: dict,
                 shapes: dict, file: str) -> ModulePlan:
    name = module_name(layer, module, model_cfg)
    keys = found.get((layer, module), {})
    if layer == END_GROUP and cfg.use_dora:
        raise AdapterError(f"use_dora=true with {name} in target_modules: DoRA is served on "
                           f"the decoder's projections only", feature="use_dora", file=cfg.file)
    factors = "ABM" if cfg.use_dora else "AB"
    for factor in factors:
        if factor not in keys:
            key = _FACTOR_KEYS[factor]
            if module == "embed_tokens":
                key = f"lora_embedding_{factor}"
            raise AdapterError(f"missing tensor base_model.model.{name}.{key} "
                               f"(target_modules selects {name})", feature="missing_tensor",
                               file=file)
    r = cfg.rank_of(name)
    k_in, n_out = full_shape(model_cfg, module)
    wants = {"A": (r, k_in), "B": (n_out, r), "M": (n_out,)}
    for factor in factors:
        check_factor(keys[factor], shapes[keys[factor]], wants[factor],
                     f"rank {r}, base module {name}", file)
    return ModulePlan(layer, module, r, cfg.scaling_of(name), keys["A"], keys["B"],
                      keys.get("M"))
