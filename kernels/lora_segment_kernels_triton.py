"""Triton programs of the LoRA prefill path: a grouped GEMM over a tile list (host wrappers:
kernels/lora_segment_triton.py).

The step's tokens are sorted by adapter slot (`LoRAMeta.sorted_tokens`); each run of one
slot (a segment) is cut into row tiles of BLOCK_M sorted tokens. The tile list, built on
the device, gives every tile its slot, its first sorted position and its row count
(0 = no tile: the list is padded to a static bound, so those programs return at once).
Every program of a launch is one tile (times a K split or an N chunk), so no program
walks a (segment, row block) pair that has no rows, whatever the adapter count.

Weights: a [L, S, R, K], b [L, N, R]. The shrink writes split-K partial sums
hp [split_k, S, T, R] (float32, rows by token index, as the token path's) with plain
stores; the expand adds the partials while it loads them (no memset, no atomics).
split_k is a runtime argument, not a constexpr, so that the compiled variants do not
depend on the token count (engine/warmup.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.dot_triton import dot_f32


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
