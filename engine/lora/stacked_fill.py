"""Filling one stacked group of an adapter's host copy (engine/lora/weights.py) with a few
tensor operations per slice instead of a few per (layer, slice).

A group's stacked tensors are a [L, S, R, K] and b [L, N, R]. When every layer wraps a
slice with one rank, dtype and scaling (the common case: one rank everywhere), the L
lora_A tensors of that slice lie in the file at offsets that are, sorted, a constant
stride apart (a safetensors file stores each layer's tensors as one block, layers in the
lexicographic order of their names: 0, 1, 10, 11, ..., 2, 20, ...). They are then one
strided view of the file's bytes, [L, r, K] in file order, written into a[:, s, :r] with
one copy per run of consecutive layers (7 runs for 32 layers in that order; an index_put_
over the permutation is several times slower than plain copies); the same for lora_B,
scaled on the way. Each operation releases the GIL for many layers, so loads on threads
convert in parallel instead of taking turns at the GIL between hundreds of small
operations. Anything else (ranks that differ by layer, slices wrapped in some layers only,
irregular offsets, DoRA) returns None and the caller fills the group layer by layer.
The values written are those of the layer-by-layer fill, bit for bit.
"""
from __future__ import annotations

import warnings

import torch

from loramux_core.adapter.plan import AdapterPlan, ModulePlan
from loramux_core.adapter.safetensors_buffer import TensorInfo
from loramux_core.model.lora_targets import GroupShape, lora_shard

_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32,
           "F64": torch.float64}


def compute_dtype(t: torch.Tensor, out: torch.dtype) -> torch.Tensor:
    """`t`, or `t` in float32 where converting it straight to `out` would not round as
    float32 math does (float64 or float16 sources)."""
    return t if t.dtype in (torch.float32, out) else t.float()


def fill_stacked(a: torch.Tensor, b: torch.Tensor, plan: AdapterPlan, model_cfg, tp,
                 shape: GroupShape, per_layer: dict[int, dict[int, ModulePlan]]
                 ) -> tuple[int, ...] | None:
    """Write the whole group (every layer) into `a` [L, S, R, K] and `b` [L, N, R]; the
    rank of each slice (0: not wrapped), or None, writing nothing, where the fast path
    does not apply (module docstring)."""
    num_layers = a.shape[0]
    if len(per_layer) != num_layers:
        return None
    jobs = []
    for s in range(len(shape.out_features)):
        mps = [per_layer[layer].get(s) for layer in range(num_layers)]
        if all(mp is None for mp in mps):
            jobs.append(None)
            continue
        if any(mp is None for mp in mps) or len({(mp.rank, mp.scaling) for mp in mps}) != 1:
            return None
        src_a = _strided(plan, [mp.a_key for mp in mps])
        src_b = _strided(plan, [mp.b_key for mp in mps])
        if src_a is None or src_b is None:
            return None
        jobs.append((mps[0], src_a, src_b))
    ranks, offset, r_max = [], 0, a.shape[2]
    for s, width in enumerate(shape.out_features):
        a_s, b_s = a[:, s], b[:, offset:offset + width]
        offset += width
        if jobs[s] is None:
            a_s.zero_()
            b_s.zero_()
            ranks.append(0)
            continue
        mp, (src_a, runs), (src_b, _) = jobs[s]
        src_a, src_b = _cut(model_cfg, tp, mp, src_a, src_b)
        r = mp.rank
        _put(a_s[:, :r], runs, src_a, None)
        _put(b_s[:, :, :r], runs, src_b, mp.scaling)
        if r < r_max:
            a_s[:, r:].zero_()
            b_s[:, :, r:].zero_()
        ranks.append(r)
    return tuple(ranks)


def _strided(plan: AdapterPlan, keys: list[str]):
    """(the tensors `keys` (one per layer, alike) as one [L, ...] view of the file's bytes
    in file order, its runs of consecutive layers), or None when their offsets are not
    evenly spaced."""
    infos: list[TensorInfo] = [plan.tensors[k] for k in keys]
    first = infos[0]
    if any(i.dtype != first.dtype or i.shape != first.shape for i in infos):
        return None
    dtype = _DTYPES.get(first.dtype)
    if dtype is None:
        return None
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = first.end - first.start
    order = sorted(range(len(infos)), key=lambda layer: infos[layer].start)
    starts = [infos[layer].start for layer in order]
    stride = starts[1] - starts[0] if len(starts) > 1 else nbytes
    if stride < nbytes or stride % itemsize or nbytes == 0 or any(
            y - x != stride for x, y in zip(starts, starts[1:])):
        return None
    lo, hi = starts[0], starts[-1] + nbytes
    with warnings.catch_warnings():  # the file's bytes are only read, never written
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(memoryview(plan.weights)[lo:hi], dtype=dtype)
    inner = [1] * len(first.shape)
    for d in range(len(first.shape) - 2, -1, -1):
        inner[d] = inner[d + 1] * first.shape[d + 1]
    view = flat.as_strided((len(infos), *first.shape), (stride // itemsize, *inner))
    return view, _runs(order)


def _runs(order: list[int]) -> list[tuple[int, int, int]]:
    """(file position, layer, count) of each run of consecutive layers in file order:
    0, 1, 10, ..., 19, 2, 20, ... is 7 runs for 32 layers, 1 for layers in numeric order."""
    out, i = [], 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and order[j + 1] == order[j] + 1:
            j += 1
        out.append((i, order[i], j - i + 1))
        i = j + 1
    return out


def _cut(model_cfg, tp, mp: ModulePlan, a: torch.Tensor, b: torch.Tensor):
    """This rank's part of the stacked (A [L, r, K], B [L, N, r]), as weights._shard cuts
    one layer's."""
    cut = lora_shard(model_cfg, mp.module, tp.rank, tp.size)
    if cut.factor == "B":
        return a, b[:, cut.shard.start:cut.shard.stop, :]
    return a[:, :, cut.shard.start:cut.shard.stop], b


def _put(dst: torch.Tensor, runs, src: torch.Tensor, scaling: float | None) -> None:
    """dst[layer] = src[file position] (times `scaling`, None for A), one operation per run
    of layers, each the operation the layer-by-layer fill runs (the same rounding)."""
    for at, layer, n in runs:
        d, s = dst[layer:layer + n], compute_dtype(src[at:at + n], dst.dtype)
        if scaling is None:
            d.copy_(s)
        else:
            torch.mul(s, scaling, out=d)
