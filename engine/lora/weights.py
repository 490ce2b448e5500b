"""A LoRA adapter read into host memory, laid out for the slot pool of one tensor-parallel rank.

Per decoder layer and LoRA group (engine/model/lora_targets.py), with S slices, this
rank's input width K and output widths n_0..n_{S-1} (N = sum):

    a: [S, R, K]   slice s holds lora_A of its module in rows 0..r_s-1 (zero below)
    b: [N, R]      rows off_s..off_s+n_s-1 hold lora_B * scaling of slice s, cols 0..r_s-1

R is the largest rank among the group's slices. Tensor parallelism follows DESIGN.md:
column-parallel groups (qkv, gate_up) keep A whole and cut B's rows like the base weight;
row-parallel groups (o, down) cut A's columns and keep B whole, so each rank's partial
delta is summed by the layer's existing all-reduce.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from engine.errors import AdapterError
from engine.lora.host_buffers import HostBuffer, HostBufferPool
from engine.lora.plan import AdapterPlan, ModulePlan, plan_adapter
from engine.lora.st_views import SafetensorsViews
from engine.model.lora_targets import LORA_TARGETS, GroupShape, lora_group_shapes, lora_shard
from engine.parallel import TPGroup


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
    buffer: HostBuffer | None = None  # the host memory every group tensor views, if one

    @property
    def nbytes(self) -> int:
        return sum(g.a.nbytes + g.b.nbytes for g in self.groups.values())

    def pin_memory(self) -> "LoRAWeights":
        """A copy in page-locked memory, so pool loads can copy asynchronously (itself
        when it already is)."""
        if all(g.a.is_pinned() and g.b.is_pinned() for g in self.groups.values()):
            return self
        pinned = {k: GroupWeights(g.a.pin_memory(), g.b.pin_memory(), g.slice_ranks)
                  for k, g in self.groups.items()}
        return LoRAWeights(MappingProxyType(pinned), self.shapes, self.num_layers,
                           self.max_rank, self.target_modules, self.tp_rank, self.tp_size,
                           self.source)


def validate_lora(path: str | Path, model_cfg, max_lora_rank: int) -> AdapterPlan:
    """Check an adapter directory against the base model without reading tensor data
    (config, tensor names, shapes); raises AdapterError. Same checks as `load_lora`,
    except the finiteness of values, which needs the data."""
    return plan_adapter(path, model_cfg, max_lora_rank)


def load_lora(path: str | Path, model_cfg, max_lora_rank: int, tp: TPGroup = TPGroup.single(),
              dtype: torch.dtype = torch.float32,
              buffers: HostBufferPool | None = None) -> LoRAWeights:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into
    this rank's host layout, scaling folded into B. Raises AdapterError (feature, file)
    for anything that is not a plain LoRA fitting the model; nothing is kept on error.

    The weights file is memory-mapped and converted in one pass (dtype, scaling, TP cut,
    layout) straight into one buffer from `buffers` (page-locked on CUDA, reused across
    adapters: engine/lora/host_buffers.py); the values are checked after that
    conversion, i.e. exactly what a slot will hold. Every group tensor is a view of
    that buffer, valid while the returned LoRAWeights lives."""
    plan = plan_adapter(path, model_cfg, max_lora_rank)
    shapes = lora_group_shapes(model_cfg, tp.size)
    by_group: dict[tuple[int, str], dict[int, ModulePlan]] = {}
    for mp in plan.modules:
        group, s = LORA_TARGETS[mp.module]
        by_group.setdefault((mp.layer, group), {})[s] = mp
    layout, nbytes = _layout(by_group, shapes, dtype)
    pool = buffers if buffers is not None else HostBufferPool()
    buf = pool.acquire(nbytes)
    try:
        groups = {}
        with SafetensorsViews(plan.weights_file) as st:
            for key, (a_at, b_at) in layout.items():
                a, b = _view(buf, a_at, dtype), _view(buf, b_at, dtype)
                groups[key] = _fill_group(a, b, st, model_cfg, tp, shapes[key[1]],
                                          by_group[key])
        _check_finite(groups, by_group, shapes, plan.weights_file)
    except BaseException:
        pool.release(buf)
        raise
    weights = LoRAWeights(MappingProxyType(groups), MappingProxyType(shapes),
                          model_cfg.num_layers, plan.max_rank, plan.target_modules,
                          tp.rank, tp.size, plan.weights_file, buffer=buf)
    pool.attach(weights, buf)
    return weights


def _layout(by_group: dict, shapes: dict, dtype: torch.dtype):
    """{(layer, group): ((a offset, a shape), (b offset, b shape))} in one buffer, each
    tensor 256-byte aligned; and the buffer's size in bytes."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    out, at = {}, 0
    for key, slices in by_group.items():
        shape = shapes[key[1]]
        r = max(mp.rank for mp in slices.values())
        parts = []
        for dims in ((len(shape.out_features), r, shape.in_features),
                     (sum(shape.out_features), r)):
            parts.append((at, dims))
            at += -(-math.prod(dims) * itemsize // 256) * 256
        out[key] = tuple(parts)
    return out, max(at, 256)


def _view(buf: HostBuffer, at: tuple[int, tuple[int, ...]], dtype: torch.dtype) -> torch.Tensor:
    offset, dims = at
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = buf.data[offset:offset + math.prod(dims) * itemsize]
    return raw.view(dtype).view(dims)


def _fill_group(a: torch.Tensor, b: torch.Tensor, st: SafetensorsViews, model_cfg,
                tp: TPGroup, shape: GroupShape, slices: dict[int, ModulePlan]) -> GroupWeights:
    """Write one group's slices into its views a [S, R, K], b [N, R] (zeros where a slice
    is absent or of a smaller rank); every element is written once."""
    r = a.shape[1]
    ranks = [0] * a.shape[0]
    offset = 0
    for s, width in enumerate(shape.out_features):
        mp = slices.get(s)
        a_s, b_s = a[s], b[offset:offset + width]
        if mp is None:
            a_s.zero_()
            b_s.zero_()
        else:
            lora_a, lora_b = _shard(st, model_cfg, tp, mp)
            a_s[:mp.rank].copy_(_compute_dtype(lora_a, a.dtype))
            torch.mul(_compute_dtype(lora_b, b.dtype), mp.scaling, out=b_s[:, :mp.rank])
            a_s[mp.rank:].zero_()
            b_s[:, mp.rank:].zero_()
            ranks[s] = mp.rank
        offset += width
    assert r == max(ranks), (r, ranks)
    return GroupWeights(a, b, tuple(ranks))


def _compute_dtype(t: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """Keep `t` when converting it to `out` rounds once as float32 math would; else float32
    first (float64 or float16 sources)."""
    return t if t.dtype in (torch.float32, out) else t.float()


def _shard(st: SafetensorsViews, model_cfg, tp: TPGroup, mp: ModulePlan
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (lora_A, lora_B) of one module: views of the file's bytes."""
    cut = lora_shard(model_cfg, mp.module, tp.rank, tp.size)
    a, b = st.get(mp.a_key), st.get(mp.b_key)
    if cut.factor == "B":
        return a, b[cut.shard.start:cut.shard.stop, :]
    return a[:, cut.shard.start:cut.shard.stop], b


def _check_finite(groups: dict, by_group: dict, shapes: dict, file: str) -> None:
    """Every converted value is finite (NaN propagates through aminmax; one pass per
    tensor, far cheaper than isfinite). On failure, name the first bad tensor."""
    bounds = [torch.stack(torch.aminmax(t)).float()
              for g in groups.values() for t in (g.a, g.b)]
    if bool(torch.isfinite(torch.stack(bounds)).all()):
        return
    for key, g in groups.items():
        offset = 0
        for s, width in enumerate(shapes[key[1]].out_features):
            mp = by_group[key].get(s)
            if mp is not None:
                for name, t in ((mp.a_key, g.a[s]), (mp.b_key, g.b[offset:offset + width])):
                    if not bool(torch.isfinite(t).all()):
                        raise AdapterError(
                            f"tensor {name!r} holds non-finite values (NaN or inf) in the "
                            f"serving dtype, after scaling", feature="non_finite", file=file)
            offset += width
    raise AdapterError("adapter holds non-finite values", feature="non_finite", file=file)
