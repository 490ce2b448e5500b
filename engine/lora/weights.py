"""A LoRA adapter read into host memory, laid out for the slot pool of one tensor-parallel rank.

Per decoder layer and LoRA group (loramux_core/model/lora_targets.py), with S slices, this
rank's input width K and output widths n_0..n_{S-1} (N = sum):

    a: [S, R, K]   slice s holds lora_A of its module in rows 0..r_s-1 (zero below)
    b: [N, R]      rows off_s..off_s+n_s-1 hold lora_B * scaling of slice s, cols 0..r_s-1

    m: [N]      DoRA adapters only: each wrapped slice's magnitude vector (this rank's
                rows of a column-parallel group; whole for a row-parallel one)

R is the largest rank among the group's slices in any layer. Each is a view of one tensor
per group stacked over the layers (`LoRAWeights.stacked`: a [L, S, R, K], b [L, N, R],
zero in layers the adapter does not wrap), and the groups lie one after the other in one
host buffer, so a slot load is one copy of the buffer and one strided copy per group
(engine/lora/pool.py), not two per layer. Values are checked where they are served:
after the cast to the serving dtype and with the scaling folded in, every element of A
and of B·scaling must be finite and at most MAX_ABS_WEIGHT in magnitude (trained LoRA
factors are of order 1 or below; far larger values, e.g. from a huge lora_alpha, turn
activations into inf/NaN), otherwise AdapterError names the tensor. Tensor parallelism
follows docs/ARCHITECTURE.md: column-parallel groups (qkv, gate_up) keep A whole and cut
B's rows like the base weight; row-parallel groups (o, down) cut A's columns and keep B
whole, so each rank's partial delta is summed by the layer's existing all-reduce.

The conversion (dtype, scaling, TP cut, layout) runs once per adapter, in one pass from
the file's bytes (read once by the plan) straight into one host buffer per adapter,
reused across adapters and page-locked on CUDA (engine/lora/host_buffers.py); a slot
load is then plain copies. Every group tensor is a view of that buffer, valid while the
LoRAWeights lives.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import math

import torch

from loramux_engine.lora.host_buffers import HostBuffer, HostBufferPool
from loramux_engine.lora.stacked_fill import compute_dtype, fill_stacked
from loramux_core.adapter.plan import AdapterPlan, ModulePlan, PlanCache, plan_adapter
from loramux_engine.lora.tensor_view import tensor
from loramux_core.model.lora_targets import (END_GROUP, GroupShape, expert_factors,
                                             lora_group_shapes, lora_shard, target)
from loramux_engine.parallel import TPGroup
from loramux_core.errors import AdapterChangedError, AdapterError
from loramux_core.file_digest import FINGERPRINT_PREFIX

MAX_ABS_WEIGHT = 1e4


@dataclass(frozen=True)
class GroupWeights:
    """One (layer, group) of one adapter on one rank; see the module docstring."""
    a: torch.Tensor                 # [S, R, K]
    b: torch.Tensor                 # [N, R], scaling folded in
    slice_ranks: tuple[int, ...]    # rank of each slice; 0 = slice not wrapped
    magnitude: torch.Tensor | None = None  # [N], DoRA only (see the module docstring)

    @property
    def rank(self) -> int:
        return max(self.slice_ranks)


class LayerGroups(Mapping):
    """`LoRAWeights.groups` of weights laid out in stacked tensors: each (layer, group)'s
    GroupWeights is made when asked for (its A and B the rows `layer` of the group's
    stacked tensors), not kept. A host copy then holds a few tracked objects instead of
    four per (layer, group): CPython's full collections walk every host copy the engine
    keeps (hundreds of adapters, ~130 groups each at 32 layers), on the step thread."""

    def __init__(self, stacked: Mapping, ranks: dict, magnitudes: dict | None = None):
        """`ranks`: (layer, group) -> its slice ranks, for the pairs the adapter wraps;
        `magnitudes`: (layer, group) -> DoRA magnitude, where there is one."""
        self._stacked, self._ranks = stacked, ranks
        self._magnitudes = magnitudes or {}

    def __getitem__(self, key) -> GroupWeights:
        ranks = self._ranks[key]
        a, b = self._stacked[key[1]]
        return GroupWeights(a[key[0]], b[key[0]], ranks, self._magnitudes.get(key))

    def __iter__(self):
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def __contains__(self, key) -> bool:
        return key in self._ranks

    def rank(self, key) -> int:
        return max(self._ranks[key])

    @property
    def any_magnitude(self) -> bool:
        return bool(self._magnitudes)


@dataclass(frozen=True)
class LoRAWeights:
    """A whole adapter for one rank: `groups[(layer, group)]` exists only where the adapter
    wraps at least one slice of that group."""
    groups: Mapping                 # (layer, group) -> GroupWeights (LayerGroups or a dict)
    shapes: MappingProxyType        # group -> GroupShape (this rank's widths)
    num_layers: int
    max_rank: int
    target_modules: frozenset[str]  # HF module kinds wrapped in at least one layer
    tp_rank: int
    tp_size: int
    source: str                     # the adapter's weights file, for messages
    version: str = ""               # digest of the files it was built from
    buffer: HostBuffer | None = None  # the host memory every group tensor views, if one
    # group -> (a [L, S, R, K], b [L, N, R]), the stacked tensors `groups` view (module
    # docstring); empty for weights not built by weights_from_plan
    stacked: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # LoRA on the ends (loramux_core/model/lora_targets.py END_TARGETS):
    # module -> (A, B * scaling)
    ends: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # LoRA on fused expert weights (the architecture's expert_targets): (layer, param) ->
    # (a [E, r, in], b [E, out, r] * scaling), this rank's part
    experts: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    @property
    def nbytes(self) -> int:
        return (sum(g.a.nbytes + g.b.nbytes for g in self.groups.values())
                + sum(a.nbytes + b.nbytes for a, b in (*self.ends.values(),
                                                       *self.experts.values())))

    @property
    def buffer_bytes(self) -> int:
        """Bytes of `buffer` the stacked tensors occupy, from its start."""
        if self.buffer is None or not self.stacked:
            return 0
        base = self.buffer.data.data_ptr()
        return max(t.data_ptr() - base + t.nbytes for ab in self.stacked.values() for t in ab)

    @property
    def use_dora(self) -> bool:
        if isinstance(self.groups, LayerGroups):
            return self.groups.any_magnitude
        return any(g.magnitude is not None for g in self.groups.values())

    def rank_of(self, key) -> int:
        """The largest slice rank of one (layer, group); 0 where the adapter has none."""
        if key not in self.groups:
            return 0
        if isinstance(self.groups, LayerGroups):
            return self.groups.rank(key)
        return self.groups[key].rank

    @property
    def pinned(self) -> bool:
        """Every tensor is in page-locked memory (device copies from it may be async)."""
        if self.buffer is not None:
            return self.buffer.pinned
        return all(g.a.is_pinned() and g.b.is_pinned() for g in self.groups.values())

    def pin_memory(self) -> "LoRAWeights":
        """A copy in page-locked memory, so pool loads can copy asynchronously (itself
        when it already is)."""
        if self.pinned:
            return self
        pinned = {k: GroupWeights(g.a.pin_memory(), g.b.pin_memory(), g.slice_ranks,
                                  None if g.magnitude is None else g.magnitude.pin_memory())
                  for k, g in self.groups.items()}
        ends = {m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in self.ends.items()}
        experts = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in self.experts.items()}
        return LoRAWeights(MappingProxyType(pinned), self.shapes, self.num_layers,
                           self.max_rank, self.target_modules, self.tp_rank, self.tp_size,
                           self.source, self.version, ends=MappingProxyType(ends),
                           experts=MappingProxyType(experts))


def validate_lora(path: str | Path, model_cfg, max_lora_rank: int, roots=None,
                  header_only: bool = False) -> AdapterPlan:
    """Check an adapter directory against the base model without building tensors
    (config, tensor names, shapes; files read and hashed once: plan.version); raises
    AdapterError. Same checks as `load_lora`, except the values, which depend on the
    serving dtype. `header_only`: the weights file's tensors are neither read nor hashed
    (no version: for a caller whose engines read and hash the files next)."""
    return plan_adapter(path, model_cfg, max_lora_rank, roots, header_only=header_only)


def load_lora(path: str | Path, model_cfg, max_lora_rank: int, tp: TPGroup = TPGroup.single(),
              dtype: torch.dtype = torch.float32, roots=None,
              expected_version: str | None = None,
              buffers: HostBufferPool | None = None,
              plan_cache: PlanCache | None = None,
              base_layers=None) -> LoRAWeights:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors; below
    `roots` when given) into this rank's host layout, scaling folded into B, in a buffer
    from `buffers` (a private one when None). Raises AdapterError (feature, file) for
    anything that is not a plain LoRA fitting the model, or when the files' version is
    not `expected_version`; nothing is kept on error. `plan_cache`: what earlier plans of
    this model derived from identical config and header bytes (loramux_core/adapter/plan.py).
    `base_layers` (engine/lora/base_copies.py BaseLayers): checks the full copies of base
    layers a file may hold; without it such a file is refused."""
    pool = buffers if buffers is not None else HostBufferPool()
    reads: list[HostBuffer] = []

    def alloc(nbytes: int) -> memoryview:
        reads.append(pool.scratch.acquire(nbytes))
        return memoryview(reads[-1].data.numpy())
    try:
        plan = plan_adapter(path, model_cfg, max_lora_rank, roots, alloc, cache=plan_cache)
        if plan.base_copies:
            _check_base_copies(plan, base_layers)
        # converted while the last chunks of the files still hash on other threads
        weights = weights_from_plan(plan, model_cfg, tp, dtype, pool)
        _check_version(plan, expected_version, path)
        return weights
    finally:  # nothing built views the bytes read (the conversion copied them)
        for buf in reads:
            pool.scratch.release(buf)


def weights_from_plan(plan: AdapterPlan, model_cfg, tp: TPGroup = TPGroup.single(),
                      dtype: torch.dtype = torch.float32,
                      buffers: HostBufferPool | None = None,
                      stacked_fill: bool = True) -> LoRAWeights:
    """This rank's host layout of a planned adapter, built from the bytes the plan read,
    values checked as served (module docstring). `stacked_fill`: groups wrapped alike in
    every layer are filled with a few operations per slice (engine/lora/stacked_fill.py);
    False fills every group layer by layer (the same bytes; tests compare the two)."""
    shapes = lora_group_shapes(model_cfg, tp.size)
    by_group: dict[tuple[int, str], dict[int, ModulePlan]] = {}
    for mp in plan.modules:
        if mp.layer == END_GROUP or mp.expert_param is not None:
            continue
        t = target(model_cfg, mp.module)
        by_group.setdefault((mp.layer, t.group), {})[t.slice] = mp
    layout, gaps, nbytes = _layout(by_group, shapes, model_cfg.num_layers, dtype,
                                   plan.config.use_dora)
    ends = _end_weights(plan, dtype)
    experts = _expert_weights(plan, model_cfg, tp, dtype)
    pool = buffers if buffers is not None else HostBufferPool()
    buf = pool.acquire(max(nbytes, 256))   # (full_copy_bytes: the same floor)
    try:
        stacked, groups = {}, {}
        for group, parts in layout.items():
            a, b, *m = (_view(buf, at, dtype) for at in parts)
            stacked[group] = (a, b)
            per_layer = {layer: s for (layer, g), s in by_group.items() if g == group}
            ranks = None if m or not stacked_fill else fill_stacked(
                a, b, plan, model_cfg, tp, shapes[group], per_layer)
            if ranks is not None:  # every layer at once (engine/lora/stacked_fill.py)
                groups.update({(layer, group): GroupWeights(a[layer], b[layer], ranks)
                               for layer in range(model_cfg.num_layers)})
                continue
            for layer in range(model_cfg.num_layers):
                m_l = m[0][layer] if m else None
                slices = by_group.get((layer, group))
                if slices is None:  # not wrapped here: zeros, as in an empty slot
                    for t in (a[layer], b[layer], m_l):
                        if t is not None:
                            t.zero_()
                    continue
                groups[(layer, group)] = _fill_group(a[layer], b[layer], m_l, plan, model_cfg,
                                                     tp, shapes[group], slices)
        for start, end in gaps:
            buf.data[start:end].zero_()
        if not _all_within_bounds(buf.data[:nbytes].view(dtype)):
            _check_groups(groups, by_group, shapes, plan.weights_file)
    except BaseException:
        pool.release(buf)
        raise
    stacked = MappingProxyType(stacked)
    weights = LoRAWeights(layer_groups(stacked, groups), MappingProxyType(shapes),
                          model_cfg.num_layers, plan.max_rank, plan.target_modules,
                          tp.rank, tp.size, plan.weights_file, plan.version, buffer=buf,
                          stacked=stacked, ends=MappingProxyType(ends),
                          experts=MappingProxyType(experts))
    pool.attach(weights, buf)
    return weights


def layer_groups(stacked: Mapping, groups: dict) -> LayerGroups:
    """The LayerGroups of `groups`, GroupWeights whose A and B are rows of `stacked`."""
    return LayerGroups(stacked, {k: g.slice_ranks for k, g in groups.items()},
                       {k: g.magnitude for k, g in groups.items() if g.magnitude is not None})


def check_lora(path: str | Path, model_cfg, max_lora_rank: int, roots=None,
               expected_version: str | None = None,
               plan_cache: PlanCache | None = None) -> AdapterPlan:
    """What `load_lora` checks without reading the weights (config, header, shapes,
    dtypes, file size), for an adapter registered now and read
    at its first use; the plan's fingerprint is its version until then. An
    `expected_version` that is a fingerprint must be this one (AdapterChangedError); a
    content version can only be checked by the read."""
    plan = plan_adapter(path, model_cfg, max_lora_rank, roots, header_only=True,
                        cache=plan_cache)
    if expected_version and expected_version.startswith(FINGERPRINT_PREFIX):
        _check_version(plan, expected_version, path)
    return plan


def _check_base_copies(plan: AdapterPlan, base_layers) -> None:
    if base_layers is None:
        raise AdapterError(f"tensor {plan.base_copies[0][1]!r} is a full copy of a base layer, "
                           f"which this reader cannot compare with the base model",
                           feature="save_embedding_layers", file=plan.weights_file)
    base_layers.check(plan)


def _check_version(plan: AdapterPlan, expected: str | None, path) -> None:
    if expected is not None and not plan.has_version(expected):
        raise AdapterChangedError("adapter files changed since this version was validated "
                                  "or loaded; register or load the name again to serve them",
                                  file=str(path))


def _end_weights(plan: AdapterPlan, dtype: torch.dtype) -> dict:
    """{module: (A, B * scaling)} of the end targets, in `dtype`, values checked."""
    out = {}
    for mp in plan.modules:
        if mp.layer != END_GROUP:
            continue
        # copied: the bytes read go back to a pool once the adapter is built
        a = compute_dtype(tensor(plan.weights, plan.tensors[mp.a_key]), dtype).to(dtype,
                                                                                   copy=True)
        b = (compute_dtype(tensor(plan.weights, plan.tensors[mp.b_key]), dtype)
             * mp.scaling).to(dtype)
        _check_values(a, mp.a_key, "", plan.weights_file)
        _check_values(b, mp.b_key, f" times scaling {mp.scaling:g}", plan.weights_file)
        out[mp.module] = (a.contiguous(), b.contiguous())
    return out


def _expert_weights(plan: AdapterPlan, model_cfg, tp: TPGroup, dtype: torch.dtype) -> dict:
    """{(layer, param): (a [E, r, in], b [E, out, r] * scaling)} of this rank, in `dtype`,
    values checked."""
    out = {}
    for mp in plan.modules:
        if mp.expert_param is None:
            continue
        lora_a = compute_dtype(tensor(plan.weights, plan.tensors[mp.a_key]), dtype)
        lora_b = compute_dtype(tensor(plan.weights, plan.tensors[mp.b_key]), dtype)
        a, b = expert_factors(model_cfg, mp.expert_param, lora_a, lora_b, mp.rank,
                              tp.rank, tp.size)
        # copies: the bytes read go back to a pool once the adapter is built
        a = a.to(dtype, copy=True).contiguous()
        b = (b * mp.scaling).to(dtype).contiguous()
        _check_values(a, mp.a_key, "", plan.weights_file)
        _check_values(b, mp.b_key, f" times scaling {mp.scaling:g}", plan.weights_file)
        out[(mp.layer, mp.expert_param)] = (a, b)
    return out


def _layout(by_group: dict, shapes: dict, num_layers: int, dtype: torch.dtype,
            use_dora: bool):
    """{group: ((a offset, a dims), (b offset, b dims)[, (m offset, m dims)])} of the
    stacked tensors (module docstring) in one buffer, each 256-byte aligned, for every
    group the adapter wraps in some layer; the (start, end) byte gaps alignment leaves;
    and the bytes used (0 for an adapter on experts or ends only)."""
    ranks: dict[str, int] = {}
    for (_, group), slices in by_group.items():
        ranks[group] = max(ranks.get(group, 0), *(mp.rank for mp in slices.values()))
    return _layout_of_ranks(ranks, shapes, num_layers, dtype, use_dora)


def full_copy_bytes(model_cfg, max_lora_rank: int, tp_size: int, dtype: torch.dtype) -> int:
    """The bytes `weights_from_plan` asks its pool for when an adapter wraps every LoRA
    group of the model at `max_lora_rank` (no DoRA): the largest host copy of a plain
    adapter on one rank, what a host reserve makes buffers of
    (engine/lora/host_reserve.py)."""
    shapes = lora_group_shapes(model_cfg, tp_size)
    _, _, nbytes = _layout_of_ranks({g: max_lora_rank for g in shapes}, shapes,
                                    model_cfg.num_layers, dtype, False)
    return max(nbytes, 256)


def _layout_of_ranks(ranks: dict[str, int], shapes: dict, num_layers: int,
                     dtype: torch.dtype, use_dora: bool):
    """_layout for the groups in `ranks`, each of that rank."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out, gaps, at = {}, [], 0
    for group in shapes:   # the architecture's groups, in declaration order
        if group not in ranks:
            continue
        shape, r, n = shapes[group], ranks[group], sum(shapes[group].out_features)
        dims = [(num_layers, len(shape.out_features), r, shape.in_features),
                (num_layers, n, r)] + [(num_layers, n)] * use_dora
        parts = []
        for d in dims:
            parts.append((at, d))
            end = at + math.prod(d) * itemsize
            at = -(-end // 256) * 256
            if at > end:
                gaps.append((end, at))
        out[group] = tuple(parts)
    return out, gaps, at


def _view(buf: HostBuffer, at: tuple[int, tuple[int, ...]], dtype: torch.dtype) -> torch.Tensor:
    offset, dims = at
    itemsize = torch.empty((), dtype=dtype).element_size()
    return buf.data[offset:offset + math.prod(dims) * itemsize].view(dtype).view(dims)


def _fill_group(a: torch.Tensor, b: torch.Tensor, m: torch.Tensor | None, plan: AdapterPlan,
                model_cfg, tp: TPGroup, shape: GroupShape,
                slices: dict[int, ModulePlan]) -> GroupWeights:
    """Write one group's slices into its views a [S, R, K], b [N, R] and (DoRA) m [N]
    (zeros where a slice is absent or of a smaller rank): every element once, in the
    serving dtype."""
    ranks = [0] * a.shape[0]
    offset = 0
    for s, width in enumerate(shape.out_features):
        mp = slices.get(s)
        a_s, b_s = a[s], b[offset:offset + width]
        if mp is None:
            a_s.zero_()
            b_s.zero_()
            if m is not None:
                m[offset:offset + width].zero_()
        else:
            lora_a, lora_b, magnitude = _shard(plan, model_cfg, tp, mp)
            if m is not None:
                m[offset:offset + width].copy_(compute_dtype(magnitude, m.dtype))
            a_s[:mp.rank].copy_(compute_dtype(lora_a, a.dtype))
            torch.mul(compute_dtype(lora_b, b.dtype), mp.scaling, out=b_s[:, :mp.rank])
            a_s[mp.rank:].zero_()
            b_s[:, mp.rank:].zero_()
            ranks[s] = mp.rank
        offset += width
    return GroupWeights(a, b, tuple(ranks), m)


def _shard(plan: AdapterPlan, model_cfg, tp: TPGroup, mp: ModulePlan):
    """This rank's (lora_A, lora_B, DoRA magnitude or None) of one module: views into the
    plan's bytes. The magnitude has one value per output row: cut like B."""
    cut = lora_shard(model_cfg, mp.module, tp.rank, tp.size)
    a = tensor(plan.weights, plan.tensors[mp.a_key])
    b = tensor(plan.weights, plan.tensors[mp.b_key])
    m = tensor(plan.weights, plan.tensors[mp.m_key]) if mp.m_key is not None else None
    if cut.factor == "B":
        rows = slice(cut.shard.start, cut.shard.stop)
        return a, b[rows, :], (m[rows] if m is not None else None)
    return a[:, cut.shard.start:cut.shard.stop], b, m


def _all_within_bounds(values: torch.Tensor) -> bool:
    """Every value finite and at most MAX_ABS_WEIGHT in magnitude: one aminmax over the
    whole buffer (NaN propagates through it)."""
    if values.numel() == 0:
        return True
    lo, hi = torch.aminmax(values)
    lo, hi = float(lo), float(hi)
    return math.isfinite(lo) and math.isfinite(hi) and max(-lo, hi) <= MAX_ABS_WEIGHT


def _check_groups(groups: dict, by_group: dict, shapes: dict, file: str) -> None:
    """After the whole-buffer check failed: the per-slice check names the tensor."""
    for key, g in groups.items():
        offset = 0
        for s, width in enumerate(shapes[key[1]].out_features):
            mp = by_group[key].get(s)
            if mp is not None:
                _check_values(g.a[s, :mp.rank], mp.a_key, "", file)
                _check_values(g.b[offset:offset + width, :mp.rank], mp.b_key,
                              f" times scaling {mp.scaling:g}", file)
                if g.magnitude is not None:
                    _check_values(g.magnitude[offset:offset + width], mp.m_key, "", file)
            offset += width
    raise AssertionError("bounds out of range but no tensor found")  # unreachable


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
