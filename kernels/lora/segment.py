"""The LoRA prefill path (kernels/lora/plan.py TILES), programs and launches: a
sort-by-adapter grouped GEMM over a tile list, two launches per layer group.

    sorted tokens   [ a a a a a | b | c c c c c c c ]      (3 segments, BLOCK_M = 4)
    tiles           (a,0,4) (a,4,1) (b,5,1) (c,6,4) (c,10,3) (-,-,0) ...
                    slot, first sorted position, rows; padded to the static bound

The tile list is built on the device from `LoRAMeta` (torch ops, no host sync) once per
step and block size, and cached on the meta, so every layer reuses it. Its length is the
static bound cdiv(T, BLOCK_M) + min(L, T) (each segment adds at most one partial tile,
rounded up to a multiple of 16),
so grids come from static sizes only and the launches stay capturable in CUDA graphs.

Launch parameters come from a small table keyed by GPU and shape class, fixed at first
use per (device, input width).

Why two launches and not one per tile: at prefill sizes the expand's bytes (y read and
written, e.g. 8192 x 28672 x 2 x 2 B for gate_up) dwarf h (S x T x R float32, from L2), and
a fused program would either stream a whole row block's output alone (one program per
tile: 128 programs for 8192 tokens, too few to keep HBM busy) or recompute its tile's
shrink for every column chunk (x read from L2 once per chunk: 12x for qkv).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32


# ---- the programs ----------------------------------------------------------------------
# Triton programs of the LoRA prefill path: a grouped GEMM over a tile list (launches: below).
#
# The step's tokens are sorted by adapter slot (`LoRAMeta.sorted_tokens`); each run of one
# slot (a segment) is cut into row tiles of BLOCK_M sorted tokens. The tile list, built on
# the device, gives every tile its slot, its first sorted position and its row count
# (0 = no tile: the list is padded to a static bound, so those programs return at once).
# Every program of a launch is one tile (times a K split or an N chunk), so no program
# walks a (segment, row block) pair that has no rows, whatever the adapter count.
#
# Weights: a [L, S, R, K], b [L, N, R]. The shrink writes split-K partial sums
# hp [split_k, S, T, R] (float32, rows by token index, as the token path's) with plain
# stores; the expand adds the partials while it loads them (no memset, no atomics).
# split_k is a runtime argument, not a constexpr, so that the compiled variants do not
# depend on the token count (engine/warmup.py).


@triton.jit
def _tile(tiles_ptr, stride_tf, t, sorted_ptr, ranks_ptr, R,
          HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """Slot, row count, token indices [BLOCK_M] (int64, masked), row mask and real rank
    of tile t; rows == 0 means no tile."""
    slot = tl.load(tiles_ptr + t)
    start = tl.load(tiles_ptr + stride_tf + t)
    rows = tl.load(tiles_ptr + 2 * stride_tf + t)
    if HAS_RANKS:
        rank = tl.minimum(tl.load(ranks_ptr + tl.maximum(slot, 0)), R)
    else:
        rank = R
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < rows
    tok = tl.load(sorted_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    return slot, rows, tok, m_mask, rank


@triton.jit
def seg_shrink_kernel(x_ptr, a_ptr, hp_ptr, tiles_ptr, sorted_ptr, ranks_ptr, K, R, S,
                      split_k, stride_tf, stride_xt, stride_xk,
                      stride_al, stride_as, stride_ar, stride_ak,
                      stride_hk, stride_hs, stride_ht, stride_hr,
                      HAS_RANKS: tl.constexpr, SLICES_PER: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_SR: tl.constexpr,
                      BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (tiles bound, split_k, slice groups): hp[ks, s, tok, :] = x[tok, K range] @
    a[slot, s, :, K range].T for the SLICES_PER slices s of group program_id(2) at once:
    one [BLOCK_M, BLOCK_K] x tile per step feeds them all (column j of the product is
    slice j // BLOCK_R of the group, rank row j % BLOCK_R)."""
    t = tl.program_id(0)
    ks = tl.program_id(1)
    slot, rows, tok, m_mask, rank = _tile(tiles_ptr, stride_tf, t, sorted_ptr, ranks_ptr, R,
                                          HAS_RANKS, BLOCK_M)
    if rows == 0:
        return
    k_chunk = tl.cdiv(tl.cdiv(K, split_k), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    offs_j = tl.arange(0, BLOCK_SR)
    js = tl.program_id(2) * SLICES_PER + offs_j // BLOCK_R
    jr = offs_j % BLOCK_R
    s_mask = (offs_j // BLOCK_R < SLICES_PER) & (js < S)
    j_mask = s_mask & (jr < rank)
    a_base = a_ptr + slot.to(tl.int64) * stride_al
    a_cols = a_base + js * stride_as + jr * stride_ar
    acc = tl.zeros([BLOCK_M, BLOCK_SR], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_cols[None, :] + offs_k[:, None] * stride_ak,
                     mask=k_mask[:, None] & j_mask[None, :], other=0.0)
        acc += dot_f32(xt.to(at.dtype), at, PRECISION, UPCAST)
    h_ptrs = (hp_ptr + ks * stride_hk + js[None, :] * stride_hs + tok[:, None] * stride_ht
              + jr[None, :] * stride_hr)
    tl.store(h_ptrs, acc, mask=m_mask[:, None] & (s_mask & (jr < R))[None, :])


@triton.jit
def seg_expand_kernel(hp_ptr, b_ptr, y_ptr, tiles_ptr, sorted_ptr, ranks_ptr, R, split_k,
                      o0, o1, o2, o3, o4, c1, c2, c3,
                      stride_tf, stride_hk, stride_hs, stride_ht, stride_hr,
                      stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                      HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_N: tl.constexpr, N_LOOP: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (column chunks of all slices, tiles bound): y[tok, chunk] += h[s, tok] @ b[slot,
    chunk].T, where h is the sum of the split_k partials. A chunk is N_LOOP tiles of
    BLOCK_N columns of one slice; c1..c3 are the first chunk indices of slices 1..3."""
    c = tl.program_id(0)
    t = tl.program_id(1)
    slot, rows, tok, m_mask, rank = _tile(tiles_ptr, stride_tf, t, sorted_ptr, ranks_ptr, R,
                                          HAS_RANKS, BLOCK_M)
    if rows == 0:
        return
    s = (c >= c1).to(tl.int32) + (c >= c2).to(tl.int32) + (c >= c3).to(tl.int32)
    first = tl.where(s == 0, 0, tl.where(s == 1, c1, tl.where(s == 2, c2, c3)))
    lo = tl.where(s == 0, o0, tl.where(s == 1, o1, tl.where(s == 2, o2, o3)))
    hi = tl.where(s == 0, o1, tl.where(s == 1, o2, tl.where(s == 2, o3, o4)))
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    h_ptrs = hp_ptr + s * stride_hs + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
    h_mask = m_mask[:, None] & r_mask[None, :]
    h = tl.load(h_ptrs, mask=h_mask, other=0.0)
    for ks in range(1, split_k):
        h += tl.load(h_ptrs + ks * stride_hk, mask=h_mask, other=0.0)
    h = h.to(b_ptr.dtype.element_ty)          # once for every column tile below
    b_base = b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
    y_rows = y_ptr + tok[:, None] * stride_yt
    n_lo = lo + (c - first) * (BLOCK_N * N_LOOP)
    for i in range(N_LOOP):
        offs_n = n_lo + i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        bt = tl.load(b_base + offs_n[None, :] * stride_bn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        delta = dot_f32(h, bt, PRECISION, UPCAST)
        y_ptrs = y_rows + offs_n[None, :] * stride_yn
        mask = m_mask[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0)
        tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


# ---- their launches --------------------------------------------------------------------

MAX_SLICES = 4
_MAX_SR = 128          # columns of one shrink program's product (slices x rank block)
_TARGET_PROGRAMS = 512  # shrink programs wanted per launch (about 4 per SM on an H100)
_MIN_K_CHUNK = 512     # below this a split-K program is mostly prologue


@dataclass(frozen=True)
class SegConfig:
    """Launch parameters of one shape class."""
    block_m: int        # sorted rows per tile (both kernels)
    block_k: int        # shrink K step
    max_split_k: int    # shrink K splits at most (partials summed by the expand)
    block_n: int        # expand tile width
    n_loop: int         # expand tiles per program (h loaded once for all of them)
    warps: int
    stages: int


# Per GPU family and shape class: "k_long" = input width above 8192 (down's 14336), else
# "k_short". H100 and H200 share one set (measured at rank 16 on an H100: NOTES
# 2026-11-25 evening); unknown GPUs and the CPU interpreter get the "default" row.
_BASE = {"k_short": SegConfig(64, 128, 8, 128, 4, 4, 3),
         "k_long": SegConfig(64, 128, 8, 128, 4, 4, 3)}
_TABLE = {"H100": _BASE, "H200": _BASE, "default": _BASE}


@functools.lru_cache(maxsize=None)
def _config(kind: str, index: int | None, Kdim: int) -> SegConfig:
    family = "default"
    if kind == "cuda":
        name = torch.cuda.get_device_name(index)
        family = next((fam for fam in _TABLE if fam in name), "default")
    return _TABLE[family]["k_long" if Kdim > 8192 else "k_short"]


def config_for(device: torch.device, Kdim: int) -> SegConfig:
    """The table's launch parameters for this device and input width (fixed per process)."""
    return _config(device.type, device.index, Kdim)


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


@functools.lru_cache(maxsize=None)
def shared_memory_bytes(kind: str, index: int | None) -> int:
    """Shared memory one program may use on this device (no limit off CUDA: the
    interpreter)."""
    if kind != "cuda":
        return 1 << 40
    from triton.runtime import driver
    index = torch.cuda.current_device() if index is None else index
    return int(driver.active.utils.get_device_properties(index)["max_shared_mem"])


def fit_block(block: int, bytes_per: int, fixed: int, stages: int, limit: int) -> int:
    """`block` halved (not below 16) until `stages` buffers of block x bytes_per plus
    `fixed` bytes fit `limit`: the table's blocks are for rank-16 tiles, and a wide rank
    block (256 in float32) would otherwise ask more shared memory than a program has."""
    while block > 16 and stages * block * bytes_per + fixed > limit:
        block //= 2
    return block


def _precision(t: torch.Tensor) -> str:
    # fp32 weights mean "exact" (tests, CPU parity); tf32 would lose ~3 digits
    return "ieee" if t.dtype == torch.float32 else "tf32"


def tiles_bound(T: int, L: int, block_m: int) -> int:
    """Static bound on (segment, row block) tiles: full blocks plus one partial per segment,
    rounded up to a multiple of 16 (the list's row stride: one compiled variant for all T)."""
    return 16 * triton.cdiv(min(T, triton.cdiv(T, block_m) + min(L, T)), 16)


def build_tiles(meta, block_m: int) -> torch.Tensor:
    """int32 [3, bound]: slot, first sorted position and row count of every tile, in segment
    order; entries past the last tile are (-1, 0, 0). Device ops only (capturable)."""
    seg_len = meta.seg_len.long()
    dev = seg_len.device
    bound = tiles_bound(meta.num_tokens, meta.num_slots, block_m)
    n = (seg_len + block_m - 1) // block_m                    # tiles per active entry
    cum = torch.cumsum(n, 0)                                  # inclusive
    t = torch.arange(bound, device=dev)
    e = torch.searchsorted(cum, t, right=True).clamp_(max=n.shape[0] - 1)
    j = t - (cum[e] - n[e])                                   # tile index inside its segment
    rows = (seg_len[e] - j * block_m).clamp_(0, block_m)
    rows = torch.where(t < cum[-1], rows, 0)
    start = torch.where(rows > 0, meta.seg_start.long()[e] + j * block_m, 0)
    slot = torch.where(rows > 0, meta.active_slots.long()[e], -1)
    return torch.stack([slot, start, rows]).to(torch.int32).contiguous()


def tiles_for(meta, block_m: int) -> torch.Tensor:
    """`build_tiles` once per (meta, block size): every layer of the step reuses it."""
    cached = meta.tiles.get(block_m)
    if cached is None:
        cached = meta.tiles[block_m] = build_tiles(meta, block_m)
    return cached


def default_split_k(m_tiles: int, groups: int, Kdim: int, cfg: SegConfig) -> int:
    """K splits so that tiles x slice groups x splits is about _TARGET_PROGRAMS, each
    split at least _MIN_K_CHUNK wide."""
    want = triton.cdiv(_TARGET_PROGRAMS, max(1, m_tiles * groups))
    return max(1, min(cfg.max_split_k, Kdim // _MIN_K_CHUNK, want))


def _slice_groups(S: int, block_r: int) -> tuple[int, int]:
    """(slices per shrink program, programs per tile) so that a program's product has at
    most _MAX_SR columns."""
    per = max(1, min(S, _MAX_SR // block_r))
    return per, triton.cdiv(S, per)


def seg_shrink(x: torch.Tensor, a: torch.Tensor, meta, ranks: torch.Tensor | None = None,
               block_m: int | None = None, split_k: int | None = None,
               block_k: int | None = None) -> torch.Tensor:
    """Split-K partials hp [split_k, S, T, R] (float32) of x[t] @ a[slot(t), s].T, rows by
    token index; rows of tokens without a slot are left unwritten (never read). Launch
    parameters not given come from the table."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    cfg = config_for(x.device, Kdim)
    block_m = block_m or cfg.block_m
    block_r = _block_r(R)
    per, groups = _slice_groups(S, block_r)
    tiles = tiles_for(meta, block_m)
    m_tiles = triton.cdiv(T, block_m)
    split_k = split_k or default_split_k(m_tiles, groups, Kdim, cfg)
    block_sr = triton.next_power_of_2(per) * block_r
    if block_k is None:   # per K step: a [block_m, k] x tile and a [k, block_sr] A tile
        block_k = fit_block(cfg.block_k, (block_m + block_sr) * a.element_size(), 0,
                            cfg.stages, shared_memory_bytes(x.device.type, x.device.index))
    hp = torch.empty((split_k, S, T, R), dtype=torch.float32, device=x.device)
    grid = (tiles.shape[1], split_k, groups)
    seg_shrink_kernel[grid](
        x, a, hp, tiles, meta.sorted_tokens, ranks if ranks is not None else meta.seg_len,
        Kdim, R, S, split_k, tiles.stride(0), x.stride(0), x.stride(1), *a.stride(),
        *hp.stride(), HAS_RANKS=ranks is not None, SLICES_PER=per, BLOCK_M=block_m,
        BLOCK_R=block_r, BLOCK_SR=block_sr, BLOCK_K=block_k,
        PRECISION=_precision(a), UPCAST=x.is_cpu, num_warps=cfg.warps, num_stages=cfg.stages)
    return hp


def seg_expand(hp: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta,
               slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
               block_m: int | None = None, block_n: int | None = None,
               n_loop: int | None = None, cfg: SegConfig | None = None) -> torch.Tensor:
    """y[t, slice s] += (sum of hp's partials)[s, t] @ b[slot(t), slice s].T, in place.
    cfg: the table's entry of the layer (default: that of a narrow input)."""
    split_k, S, T, R = hp.shape
    cfg = cfg or config_for(y.device, 0)
    block_m = block_m or cfg.block_m
    if block_n is None:   # h [block_m, R] once; per column: a B row and a y column
        block_r = _block_r(R)
        block_n = fit_block(cfg.block_n, (block_r + block_m) * b.element_size(),
                            block_m * block_r * b.element_size(), cfg.stages,
                            shared_memory_bytes(y.device.type, y.device.index))
    n_loop = n_loop or cfg.n_loop
    offs = list(slice_offsets) + [slice_offsets[-1]] * (MAX_SLICES + 1 - len(slice_offsets))
    chunk = block_n * n_loop
    firsts = [0]        # first chunk index of every slice (flattened over slices)
    for lo, hi in zip(offs, offs[1:]):
        firsts.append(firsts[-1] + triton.cdiv(hi - lo, chunk))
    chunks = firsts[S]
    # slices past S start past the last chunk, so no program maps to them
    c1, c2, c3 = (firsts[i] if i < S else chunks for i in (1, 2, 3))
    tiles = tiles_for(meta, block_m)
    if chunks == 0:
        return y
    grid = (chunks, tiles.shape[1])
    seg_expand_kernel[grid](
        hp, b, y, tiles, meta.sorted_tokens, ranks if ranks is not None else meta.seg_len, R,
        split_k, *offs, c1, c2, c3, tiles.stride(0), *hp.stride(), *b.stride(), y.stride(0),
        y.stride(1), HAS_RANKS=ranks is not None, BLOCK_M=block_m, BLOCK_R=_block_r(R),
        BLOCK_N=block_n, N_LOOP=n_loop, PRECISION=_precision(b), UPCAST=y.is_cpu,
        num_warps=cfg.warps, num_stages=cfg.stages)
    return y


def add_lora_seg(y, x, a, b, meta, slice_offsets: tuple[int, ...],
                 ranks: torch.Tensor | None = None) -> torch.Tensor:
    """The prefill path: y += LoRA(x) per token's slot, two launches over the tile list."""
    hp = seg_shrink(x, a, meta, ranks)
    return seg_expand(hp, b, y, meta, slice_offsets, ranks, cfg=config_for(x.device, x.shape[1]))
