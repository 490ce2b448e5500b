"""The mixed-adapter decode path (kernels/lora/plan.py MIXED): each adapter's rows of a
decode batch as tiles of up to block_m rows, two launches (the programs:
kernels/lora/mixed_kernels.py), and their launch parameters from a small table keyed by
GPU and shape class. The planner decides when this path runs; this module only how.

Shape class: tokens bucket (16, 64, 128, 256) and layer kind ("qkv": 3 slices, "gate_up":
2, "down": one slice narrower than its input, "o": one slice otherwise). Parameters are
chosen once per (GPU, shape) and cached; a launch only allocates the partial sums and
launches twice. Entries left at 0 (programs, split_k, tpp) are sized from the shape: about
EXPECTED_ADAPTERS + T // block_m programs along the tiles (each takes one tile of such a
batch, more of a batch with more adapters), and split-K and columns per program for
about WAVES programs per SM.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from loramux_kernels.lora import mixed_kernels as K
from loramux_kernels.lora.plan import device_facts, shape_class

MAX_SLICES = 4         # the counters hold 4 (tile, slice) entries per tile
WAVES = 4              # programs per SM the automatic split-K and columns-per-program aim at
EXPECTED_ADAPTERS = 64  # adapters in a batch the automatic sizes plan for
_MIN_K_CHUNK = 512     # below this a split-K program is mostly prologue


@dataclass(frozen=True)
class MixedParams:
    """Launch parameters of one shape class.

    block_m: rows per tile (16, 32 or 64; rows of one adapter share each tl.dot);
    programs: programs along the tiles (each loops over every programs-th tile), 0 =
    automatic;
    split_k: shrink programs per (tile, slice) over K, 0 = automatic;
    reduce: with split_k > 1, the shrink sums the partials once (arrival counters) instead
    of every expand program adding them;
    block_k, block_n: shrink K tile, expand column tile;
    tpp: column tiles per expand program, 0 = automatic;
    warps, stages: num_warps and num_stages of both launches."""
    block_m: int = 16
    programs: int = 0
    split_k: int = 0
    reduce: bool = True
    block_k: int = 256
    block_n: int = 128
    tpp: int = 0
    warps: int = 4
    stages: int = 3


SEGMENTS = MixedParams()


def _seg(programs: int, split_k: int, reduce: bool, tpp: int) -> MixedParams:
    return MixedParams(programs=programs, split_k=split_k, reduce=reduce, tpp=tpp)


# Per GPU (a substring of the device name) and shape class (kernels/lora/plan.py
# shape_class) that the planner sends here; others (and the H200, which has the H100's
# SMs) take SEGMENTS or the H100's row. The H100 rows: the best of
# benchmarks/sweep_lora_mixed.py on one H100 80GB HBM3 (2026-11-25, copy bandwidth 2.96
# TB/s; 64 adapters round robin, rank 16, bf16, Llama-3-8B groups; the us per group are
# beside the planner's entries); one program per tile (programs = T): with fewer, a batch
# of one row per adapter (256 adapters at 256 tokens) had each program walk several tiles
# one after the other (decode step 22.0 -> 29.9 ms).
PARAMS: dict[str, dict[tuple[int, str], MixedParams]] = {
    "H100": {
        (256, "qkv"): _seg(256, 3, True, 6),
        (256, "o"): _seg(256, 8, True, 4),
        (256, "gate_up"): _seg(256, 5, True, 25),
        (256, "down"): _seg(256, 6, False, 2),
        (128, "qkv"): _seg(128, 3, True, 6),
        (128, "o"): _seg(128, 6, False, 3),
        (128, "gate_up"): _seg(128, 5, False, 16),
        (128, "down"): _seg(128, 6, False, 3),
    },
}
_FALLBACK = {"H200": "H100"}


def lookup(gpu: str | None, cls: tuple[int, str]) -> MixedParams:
    """The launch parameters for a GPU key (None: unknown) and shape class."""
    while gpu is not None:
        if cls in PARAMS.get(gpu, {}):
            return PARAMS[gpu][cls]
        gpu = _FALLBACK.get(gpu)
    return SEGMENTS


def params_for(device: torch.device, T: int, S: int, K: int, widest: int) -> MixedParams:
    return lookup(device_facts(device)[0], shape_class(T, S, K, widest))


@dataclass(frozen=True)
class _Plan:
    params: MixedParams
    nseg: int
    seg_p: int
    tiles: int                       # bound on the tiles of any batch
    programs: int                    # programs along them
    split_k: int
    k_chunk: int                     # K columns per split (whole K tiles)
    reduce: bool
    block_r: int
    block_k: int
    block_n: int
    tpp: int
    items: tuple[int, int, int]      # first item of slices 1, 2, 3
    num_items: int
    offsets: tuple[int, ...]         # five slice bounds


def _auto_split(K: int, tiles: int, S: int, sms: int) -> int:
    return max(1, min(-(-WAVES * sms // (tiles * S)), K // _MIN_K_CHUNK))


def _auto_tpp(n_tiles: int, tiles: int, sms: int) -> int:
    return max(1, -(-n_tiles // max(1, -(-WAVES * sms // tiles))))


@functools.lru_cache(maxsize=None)
def _plan(device: torch.device, T: int, L: int, slice_offsets: tuple[int, ...], R: int,
          Kdim: int, params: MixedParams | None) -> _Plan:
    """Everything static about a launch, once per shape (params None: the table's)."""
    S = len(slice_offsets) - 1
    widths = [hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:])]
    _, sms = device_facts(device)
    if params is None:
        params = params_for(device, T, S, Kdim, max(widths))
    nseg = max(1, min(T, L))
    bm = params.block_m
    tiles = max(1, min(T, nseg + T // bm))
    programs = min(tiles, params.programs or EXPECTED_ADAPTERS + T // bm)
    busy = min(programs, EXPECTED_ADAPTERS)     # tiles of a usual batch
    split = params.split_k or _auto_split(Kdim, busy, S, sms)
    # A and B tiles of at most 16 KB per pipeline stage, whatever the rank
    block_r = max(16, triton.next_power_of_2(R))
    block_k = min(params.block_k, max(32, 8192 // block_r),
                  max(16, triton.next_power_of_2(Kdim)))
    block_n = min(params.block_n, max(32, 8192 // block_r))
    # K chunks of whole K tiles, none empty (split_k * k_chunk covers K)
    k_chunk = triton.cdiv(triton.cdiv(Kdim, max(1, split)), block_k) * block_k
    split = triton.cdiv(Kdim, k_chunk)
    n_tiles = [triton.cdiv(w, block_n) for w in widths]
    tpp = params.tpp or _auto_tpp(sum(n_tiles), busy, sms)
    per_slice = [triton.cdiv(n, tpp) for n in n_tiles] + [0] * (MAX_SLICES - S)
    starts = [sum(per_slice[:i]) for i in range(1, MAX_SLICES)]
    offs = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    return _Plan(params=params, nseg=nseg,
                 seg_p=triton.next_power_of_2(nseg), tiles=tiles, programs=programs,
                 split_k=split, k_chunk=k_chunk,
                 reduce=params.reduce and split > 1, block_r=block_r, block_k=block_k,
                 block_n=block_n, tpp=tpp, items=tuple(starts),
                 num_items=max(1, sum(per_slice)), offsets=tuple(offs))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def lora_shrink_mixed(x: torch.Tensor, a: torch.Tensor, meta, plan: _Plan,
                      ranks: torch.Tensor | None = None) -> torch.Tensor:
    """Partial sums hp [split_k, S, T, R] float32 of x @ A.T by *sorted position*; with
    plan.reduce their sum is in hp[0]. Rows of tokens without a slot stay unwritten."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    p = plan.params
    hp = torch.empty((plan.split_k, S, T, R), dtype=torch.float32, device=x.device)
    assert meta.counters.numel() >= plan.tiles * MAX_SLICES, "meta built for fewer tokens"
    K.lora_shrink_mixed_kernel[(plan.programs, S * plan.split_k)](
        x, a, hp, meta.counters, meta.sorted_tokens, meta.seg_start, meta.seg_len,
        meta.active_slots, ranks if ranks is not None else meta.seg_len, plan.nseg,
        plan.tiles, Kdim, R, x.stride(0), x.stride(1), *a.stride(), *hp.stride(),
        plan.split_k, plan.k_chunk, HAS_RANKS=ranks is not None, REDUCE=plan.reduce,
        SEG_P=plan.seg_p, BLOCK_M=p.block_m, BLOCK_R=plan.block_r, BLOCK_K=plan.block_k,
        PRECISION=_precision(a), UPCAST=x.is_cpu, num_warps=p.warps, num_stages=p.stages)
    return hp


def lora_expand_mixed(hp: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta, plan: _Plan,
                      ranks: torch.Tensor | None = None) -> torch.Tensor:
    """y[tok, slice s] += h[s, sorted position of tok] @ b[slot].T, in place."""
    L, N, R = b.shape
    p = plan.params
    K.lora_expand_mixed_kernel[(plan.programs, plan.num_items)](
        hp, b, y, meta.sorted_tokens, meta.seg_start, meta.seg_len, meta.active_slots,
        ranks if ranks is not None else meta.seg_len, plan.nseg, plan.tiles, R, *plan.offsets,
        *plan.items, *hp.stride(), *b.stride(), y.stride(0), y.stride(1),
        1 if plan.reduce else plan.split_k, plan.tpp, HAS_RANKS=ranks is not None,
        SEG_P=plan.seg_p, BLOCK_M=p.block_m, BLOCK_R=plan.block_r, BLOCK_N=plan.block_n,
        PRECISION=_precision(b), UPCAST=y.is_cpu, num_warps=p.warps,
        num_stages=p.stages)
    return y


def add_lora_mixed(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta,
                   slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                   params: MixedParams | None = None) -> torch.Tensor:
    """y += LoRA(x) on the segment kernels (two launches); same contract as
    loramux_kernels.lora.launch.add_lora with its checks done. params: None = the table's."""
    T, Kdim = x.shape
    plan = _plan(x.device, T, a.shape[0], tuple(slice_offsets), a.shape[2], Kdim, params)
    hp = lora_shrink_mixed(x, a, meta, plan, ranks)
    return lora_expand_mixed(hp, b, y, meta, plan, ranks)
