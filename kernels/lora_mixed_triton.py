"""Host wrappers of the mixed-adapter decode kernels (kernels/lora_mixed_kernels_triton.py)
and their launch parameters, from a small table keyed by GPU and shape class.

`add_lora` (kernels/lora_triton.py) sends a decode batch (up to TOKEN_PATH_MAX_TOKENS
tokens, not hinted uniform) here when the table's entry for its shape class says
path="segments"; "tokens" keeps the token-sized kernels (kernels/lora_token_triton.py).
A batch hinted `spread` (fewer rows per adapter than the GPU's MIN_ROWS_PER_ADAPTER, which
the caller knows on the host: `min_rows_per_adapter`) keeps the token kernels whatever
the table says: a tile of one row reads its adapter as a token program does, but costs
more.

Shape class: tokens bucket (16, 64, 128, 256) and layer kind ("qkv": 3 slices, "gate_up":
2, "down": one slice narrower than its input, "o": one slice otherwise). Parameters are
chosen once per (GPU, shape) and cached; a launch only allocates the partial sums and
launches twice. Entries left at 0 (programs, split_k, tpp) are sized from the shape: about
EXPECTED_ADAPTERS + T // block_m programs along the tiles (each takes one tile of such a
batch, more of a batch with more adapters), and split-K and columns per program for
about WAVES programs per SM.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton

from kernels import lora_mixed_kernels_triton as K

MAX_SLICES = 4         # the counters hold 4 (tile, slice) entries per tile
WAVES = 4              # programs per SM the automatic split-K and columns-per-program aim at
EXPECTED_ADAPTERS = 64  # adapters in a batch the automatic sizes plan for
_MIN_K_CHUNK = 512     # below this a split-K program is mostly prologue
_DEFAULT_SMS = 132     # the interpreter and unknown devices size grids as an H100


@dataclass(frozen=True)
class MixedParams:
    """Launch parameters of one shape class.

    path: "segments" (these kernels) or "tokens" (the token-sized kernels);
    block_m: rows per tile (16, 32 or 64; rows of one adapter share each tl.dot);
    programs: programs along the tiles (each loops over every programs-th tile), 0 =
    automatic;
    split_k: shrink programs per (tile, slice) over K, 0 = automatic;
    reduce: with split_k > 1, the shrink sums the partials once (arrival counters) instead
    of every expand program adding them;
    block_k, block_n: shrink K tile, expand column tile;
    tpp: column tiles per expand program, 0 = automatic;
    warps, stages: num_warps and num_stages of both launches."""
    path: str = "segments"
    block_m: int = 16
    programs: int = 0
    split_k: int = 0
    reduce: bool = True
    block_k: int = 256
    block_n: int = 128
    tpp: int = 0
    warps: int = 4
    stages: int = 3


TOKENS = MixedParams(path="tokens")
SEGMENTS = MixedParams()


def _seg(programs: int, split_k: int, reduce: bool, tpp: int) -> MixedParams:
    return MixedParams(programs=programs, split_k=split_k, reduce=reduce, tpp=tpp)


KINDS = ("qkv", "o", "gate_up", "down")
# Shape classes not listed take DEFAULT's entry: up to 64 tokens the token-sized kernels
# (one program per token is as good as a 16-row tile of one row there), above them these
# kernels at parameters sized from the shape (the token kernels read an adapter about
# once per row there).
DEFAULT: dict[tuple[int, str], MixedParams] = {
    **{(16, kind): TOKENS for kind in KINDS},
    **{(64, kind): TOKENS for kind in KINDS},
}
# Per GPU (a substring of the device name); an H200 has the H100's SMs and more
# bandwidth: it takes the H100 rows unless it has its own. The H100 rows: the best of
# benchmarks/sweep_lora_mixed.py on one H100 80GB HBM3 (2026-11-25, copy bandwidth 2.96
# TB/s; 64 adapters round robin, rank 16, bf16, Llama-3-8B groups), old token kernels ->
# these, us per layer group (both launches); but one program per tile (programs = T):
# with fewer, a batch of one row per adapter (256 adapters at 256 tokens) had each
# program walk several tiles one after the other and lost to the token kernels (decode
# step 22.0 -> 29.9 ms), and at 64 tokens of one row per adapter down keeps the token
# kernels too (bench_kernels: 30.3 us against 39.3).
TABLE: dict[str, dict[tuple[int, str], MixedParams]] = {
    "H100": {
        (256, "qkv"): _seg(256, 3, True, 6),      # 57.2 -> 36.7
        (256, "o"): _seg(256, 8, True, 4),        # 34.0 -> 23.9
        (256, "gate_up"): _seg(256, 5, True, 25),  # 108.7 -> 68.3
        (256, "down"): _seg(256, 6, False, 2),    # 62.1 -> 31.0
        (128, "qkv"): _seg(128, 3, True, 6),      # 37.3 -> 32.0
        (128, "o"): _seg(128, 6, False, 3),       # 23.0 -> 19.1
        (128, "gate_up"): _seg(128, 5, False, 16),  # 65.0 -> 52.3
        (128, "down"): _seg(128, 6, False, 3),    # 41.1 -> 27.3
        (64, "qkv"): TOKENS,                      # 24.4 (these: 24.5)
        (64, "o"): TOKENS,                        # 15.6 (16.7)
        (64, "gate_up"): TOKENS,                  # 43.0 (48.7)
        (64, "down"): TOKENS,                     # 30.3 (39.3)
    },
    "H200": {},
}
_FALLBACK = {"H200": "H100"}
# Rows per adapter (rows with an adapter / distinct adapters) a mixed decode batch needs
# for the table's segment entries; below it (the `spread` hint) the token kernels. Per GPU
# as TABLE. H100, one decode step (Llama-3-8B shape, bf16, rank 16, 7 projections, 32
# layers) at batch 256: 64 adapters (4 rows each) 19.20 ms on the token kernels, 16.62 ms
# on the segment kernels; 256 adapters (one row each) 22.03 ms on the token kernels,
# 29.91 ms (1db51b4) and 25.65 ms (42a0953) on the segment kernels.
MIN_ROWS_PER_ADAPTER: dict[str, int] = {"H100": 4}
DEFAULT_MIN_ROWS_PER_ADAPTER = 4    # unknown GPUs (and the interpreter), as the H100
# "tokens" or "segments": every mixed decode batch takes that path whatever the table says
# (benchmarks time both side by side); "table": the table alone, `spread` ignored (the
# choice before the rows-per-adapter rule); None: the table and the rule decide
PATH: str | None = None


def shape_class(T: int, S: int, K: int, widest: int) -> tuple[int, str]:
    bucket = 16 if T <= 16 else 64 if T <= 64 else 128 if T <= 128 else 256
    kind = ("qkv" if S >= 3 else "gate_up" if S == 2 else "down" if K > widest else "o")
    return bucket, kind


def gpu_key(name: str) -> str | None:
    """The TABLE key of a device name ("NVIDIA H100 80GB HBM3" -> "H100"), else None."""
    return next((k for k in TABLE if k in name), None)


def lookup(gpu: str | None, cls: tuple[int, str]) -> MixedParams:
    """The table entry for a GPU key (None: unknown) and shape class."""
    while gpu is not None:
        if cls in TABLE.get(gpu, {}):
            return TABLE[gpu][cls]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT.get(cls, SEGMENTS)


def min_rows(gpu: str | None, T: int) -> int:
    """The rows per adapter a mixed decode batch of T tokens needs on a GPU key (None:
    unknown) for the segment kernels (fewer: the caller hints `spread`): its
    MIN_ROWS_PER_ADAPTER, with the table's fallbacks; 0 where the hint changes no launch
    (no layer kind at T tokens takes the segment kernels)."""
    bucket, _ = shape_class(T, 1, 1, 1)
    if all(lookup(gpu, (bucket, kind)).path != "segments" for kind in KINDS):
        return 0
    while gpu is not None:
        if gpu in MIN_ROWS_PER_ADAPTER:
            return MIN_ROWS_PER_ADAPTER[gpu]
        gpu = _FALLBACK.get(gpu)
    return DEFAULT_MIN_ROWS_PER_ADAPTER


@functools.lru_cache(maxsize=None)
def _device(device: torch.device) -> tuple[str | None, int]:
    if device.type != "cuda":
        return None, _DEFAULT_SMS
    props = torch.cuda.get_device_properties(device)
    return gpu_key(props.name), props.multi_processor_count


def params_for(device: torch.device, T: int, S: int, K: int, widest: int) -> MixedParams:
    gpu, _ = _device(device)
    return lookup(gpu, shape_class(T, S, K, widest))


def min_rows_per_adapter(device: torch.device, T: int) -> int:
    """`min_rows` of this device's GPU."""
    return min_rows(_device(device)[0], T)


def takes(x: torch.Tensor, a: torch.Tensor, slice_offsets: tuple[int, ...],
          spread: bool = False) -> bool:
    """Whether this decode batch runs on the segment kernels: its shape class's entry,
    unless `spread` (fewer rows per adapter than `min_rows_per_adapter`)."""
    if PATH in ("tokens", "segments"):
        return PATH == "segments"
    if spread and PATH != "table":
        return False
    T, Kdim = x.shape
    return _plan(x.device, T, a.shape[0], slice_offsets, a.shape[2], Kdim, None).takes


@dataclass(frozen=True)
class _Plan:
    takes: bool
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
    _, sms = _device(device)
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
    return _Plan(takes=params.path == "segments", params=params, nseg=nseg,
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
    kernels.lora_triton.add_lora with its checks done. params: None = the table's."""
    T, Kdim = x.shape
    if params is not None and params.path != "segments":
        params = dataclasses.replace(params, path="segments")
    plan = _plan(x.device, T, a.shape[0], tuple(slice_offsets), a.shape[2], Kdim, params)
    hp = lora_shrink_mixed(x, a, meta, plan, ranks)
    return lora_expand_mixed(hp, b, y, meta, plan, ranks)
