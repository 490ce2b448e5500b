"""Triton programs for mixed-adapter decode batches: row tiles of slot segments.

Host wrappers: kernels/lora/mixed.py. A *segment* is the run of slot-sorted tokens
that share one adapter (`LoRAMeta.seg_start` / `seg_len` / `active_slots`); each segment
is cut into tiles of BLOCK_M rows, numbered segment by segment:

    seg_len      [ 4  4  1  0 ... ]       (BLOCK_M = 16: one tile per segment)
    seg_len      [ 20 3  0 ... ]          (tiles: rows 0-15 and 16-19 of segment 0, segment 1)

A program finds a tile from the segment lengths alone (a prefix sum over at most
min(T, slots) entries, on the device). Tiles number at most TILES = min(T, segments +
T // BLOCK_M), a static bound; axis 0 of both grids has a fixed number of programs (the
table's, about the tiles of the adapters a batch usually holds) that take tiles
program_id(0), + programs, ... below TILES, skipping those past the last tile: grids
come from static sizes only, so the launches are capturable in CUDA graphs, and a batch
with more adapters than planned for gives each program more tiles, not more programs.
The rows of a tile share each A and B tile in one tl.dot, so an adapter's A and B are
read once per tile, whatever the number of rows per adapter.

Shrink: grid (programs, S * split_k). Partial sums go to hp [split_k, S, T, R] float32 by
sorted position. With REDUCE (split_k > 1) the last program of a (tile, slice) to finish,
counted by an int32 arrival counter that it resets to 0, adds the partials up into hp[0];
the expand then reads one [BLOCK_M, R] tile. Without REDUCE the expand adds the partials.
Expand: grid (programs, work items), an item = up to tpp consecutive BLOCK_N column tiles of
one slice. split_k, partials, tpp and the tile counts are plain (unspecialised) arguments:
choosing them compiles nothing new.
"""
from __future__ import annotations

import triton
import triton.language as tl

from loramux_kernels.lora.tiles import expand_tile, rank_of, shrink_tile, slice_bounds


@triton.jit
def _segment_tiles(seg_len_ptr, NSEG, SEG_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """Per active-segment entry: its length, its tile count, and the tiles up to and
    including it (a prefix sum); tiles are numbered segment by segment."""
    offs = tl.arange(0, SEG_P)
    lens = tl.load(seg_len_ptr + offs, mask=offs < NSEG, other=0)
    n = (lens + BLOCK_M - 1) // BLOCK_M
    return lens, n, tl.cumsum(n, 0)


@triton.jit
def _tile_at(t, lens, n, ends, seg_start_ptr, active_ptr, sorted_ptr, NSEG,
             SEG_P: tl.constexpr, BLOCK_M: tl.constexpr):
    """(slot, first sorted position, rows, row mask, token of each row) of tile t: BLOCK_M
    rows of its segment (the last tile fewer); rows <= 0 past the last tile."""
    seg = tl.sum((ends <= t).to(tl.int32), 0)    # the first segment that ends past t
    here = tl.arange(0, SEG_P) == seg
    first_tile = tl.sum(tl.where(here, ends - n, 0), 0)
    seg_len = tl.sum(tl.where(here, lens, 0), 0)
    i = tl.minimum(seg, NSEG - 1)
    row0 = (t - first_tile) * BLOCK_M
    rows = tl.minimum(seg_len - row0, BLOCK_M)
    p0 = tl.load(seg_start_ptr + i) + row0
    m_mask = tl.arange(0, BLOCK_M) < rows
    tok = tl.load(sorted_ptr + p0 + tl.arange(0, BLOCK_M), mask=m_mask, other=0)
    return tl.load(active_ptr + i), p0, rows, m_mask, tok.to(tl.int64)


@triton.jit
def _h_ptrs(hp_ptr, s, p0, stride_hs, stride_ht, stride_hr, BLOCK_M: tl.constexpr,
            BLOCK_R: tl.constexpr):
    """[BLOCK_M, BLOCK_R] pointers to slice s of the partial sums, rows p0 ... (split 0)."""
    return (hp_ptr + s * stride_hs + (p0 + tl.arange(0, BLOCK_M))[:, None] * stride_ht
            + tl.arange(0, BLOCK_R)[None, :] * stride_hr)


@triton.jit(do_not_specialize=["NSEG", "TILES", "split_k", "k_chunk"])
def lora_shrink_mixed_kernel(x_ptr, a_ptr, hp_ptr, count_ptr, sorted_ptr, seg_start_ptr,
                             seg_len_ptr, active_ptr, ranks_ptr, NSEG, TILES, K, R,
                             stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                             stride_hk, stride_hs, stride_ht, stride_hr,
                             split_k, k_chunk, HAS_RANKS: tl.constexpr,
                             REDUCE: tl.constexpr, SEG_P: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                             PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (programs, S * split_k), tiles t = program_id(0), + programs, ... < TILES:
    hp[ks, s, p, :] = x[tok(p), ks * k_chunk ...] @ a[slot, s].T for the tile's sorted
    positions p; with REDUCE the sum over ks lands in hp[0]."""
    s = tl.program_id(1) // split_k
    ks = tl.program_id(1) % split_k
    lens, n, ends = _segment_tiles(seg_len_ptr, NSEG, SEG_P, BLOCK_M)
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    r_mask = tl.arange(0, BLOCK_R) < R
    for t in range(tl.program_id(0), TILES, tl.num_programs(0)):
        slot, p0, rows, m_mask, tok = _tile_at(t, lens, n, ends, seg_start_ptr, active_ptr,
                                               sorted_ptr, NSEG, SEG_P, BLOCK_M)
        if rows > 0:
            acc = shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s,
                               rank_of(ranks_ptr, slot, R, HAS_RANKS), k_lo, k_hi,
                               stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                               stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
            mask = m_mask[:, None] & r_mask[None, :]
            h_ptrs = _h_ptrs(hp_ptr, s, p0, stride_hs, stride_ht, stride_hr, BLOCK_M, BLOCK_R)
            tl.store(h_ptrs + ks * stride_hk, acc, mask=mask)
            if REDUCE:
                # every thread's partial is written before the arrival is published
                # (release); the last to arrive reads the others' (acquire; .cg: from L2,
                # not this SM's L1)
                tl.debug_barrier()
                count = count_ptr + t * 4 + s
                if tl.atomic_add(count, 1, sem="acq_rel") == split_k - 1:
                    total = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                    for j in range(split_k):
                        total += tl.load(h_ptrs + j * stride_hk, mask=mask, other=0.0,
                                         cache_modifier=".cg")
                    tl.store(h_ptrs, total, mask=mask)
                    tl.atomic_xchg(count, 0)       # ready for the next launch


@triton.jit(do_not_specialize=["NSEG", "TILES", "i1", "i2", "i3", "partials", "tpp"])
def lora_expand_mixed_kernel(hp_ptr, b_ptr, y_ptr, sorted_ptr, seg_start_ptr, seg_len_ptr,
                             active_ptr, ranks_ptr, NSEG, TILES, R, o0, o1, o2, o3, o4,
                             i1, i2, i3,
                             stride_hk, stride_hs, stride_ht, stride_hr,
                             stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                             partials, tpp, HAS_RANKS: tl.constexpr,
                             SEG_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_N: tl.constexpr,
                             PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (programs, items), tiles as the shrink's: y[tok(p), n] += (sum of `partials`
    hp[k, s, p]) @ b[slot, n].T over item i's columns. Slice s owns items [i_s, i_{s+1})
    (i0 = 0), item i of it the column tiles (i - i_s) * tpp ... + tpp - 1 of the slice."""
    i = tl.program_id(1)
    s = (i >= i1).to(tl.int32) + (i >= i2).to(tl.int32) + (i >= i3).to(tl.int32)
    item0 = tl.where(s == 0, 0, tl.where(s == 1, i1, tl.where(s == 2, i2, i3)))
    lo, hi = slice_bounds(s, o0, o1, o2, o3, o4)
    n_first = lo + (i - item0) * (tpp * BLOCK_N)
    n_last = tl.minimum(hi, n_first + tpp * BLOCK_N)
    lens, n, ends = _segment_tiles(seg_len_ptr, NSEG, SEG_P, BLOCK_M)
    for t in range(tl.program_id(0), TILES, tl.num_programs(0)):
        slot, p0, rows, m_mask, tok = _tile_at(t, lens, n, ends, seg_start_ptr, active_ptr,
                                               sorted_ptr, NSEG, SEG_P, BLOCK_M)
        if rows > 0:
            rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
            h_ptrs = _h_ptrs(hp_ptr, s, p0, stride_hs, stride_ht, stride_hr, BLOCK_M, BLOCK_R)
            h_mask = m_mask[:, None] & (tl.arange(0, BLOCK_R) < rank)[None, :]
            h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k in range(partials):
                h += tl.load(h_ptrs + k * stride_hk, mask=h_mask, other=0.0)
            for n0 in range(n_first, n_last, BLOCK_N):     # no branch: a pipelined loop
                expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank, n0, hi,
                             stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                             BLOCK_R, BLOCK_N, PRECISION, UPCAST)
