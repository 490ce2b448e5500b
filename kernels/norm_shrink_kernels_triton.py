"""Residual add + RMSNorm + LoRA shrink in one Triton launch (host wrapper:
kernels/norm_shrink_triton.py): a decoder layer's norm that makes the input of a LoRA
group (q/k/v after the input norm, gate/up after the post-attention norm) also starts
that group's shrink, so the shrink has no launch of its own and does not read the norm's
output back.

The 1-D grid has two roles, independent of each other:

- programs [0, T): one row each, the add + RMSNorm of kernels/elementwise_kernels_triton.py
  (same rounding), writing the new residual to its own tensor and the row's float32
  1/rms to `rstd`;
- programs [T, T + row blocks * SPLIT_K): (row block, K chunk): split-K partials of the
  shrink of the *unscaled* normed rows, hp[ks, s, t, :] = (w * (x + res))[t, K chunk] @
  A[slot(t), s, :, K chunk].T, all slices at once (slice and rank columns side by side,
  S * R wide); with PER_ROW (mixed batches) one row per program instead of a block.
  The row's 1/rms is a scalar of the whole row, which no K chunk knows; the expand
  multiplies each row's summed h by it (lora_expand_tokens' row_scale).

The shrink programs read x and the old residual while the norm programs run, so the new
residual is never written in place. Rows are in batch order, BLOCK_M to a block (one
adapter for all rows: A read once per block), each block done one adapter at a time
(the largest slot among its rows not done yet, until only rows without an adapter, slot
-1, are left: those get no partials and are never read). A block of one adapter is one
matrix product.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.dot_triton import dot_f32
from kernels.fused_shrink_kernels_triton import block_program, k_bounds, rank_of, row_program


@triton.jit
def _norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, row, N,
              stride_x, stride_r, stride_o, stride_ro, eps,
              HAS_ADD: tl.constexpr, BLOCK: tl.constexpr):
    """out = rms_norm(res + x) of one row, rounded as add_rms_norm_kernel; the sum goes
    to res_out (HAS_ADD), 1/rms to rstd."""
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dt = res_ptr.dtype.element_ty
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
    if HAS_ADD:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        r = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + offs, r, mask=mask)
    sf = r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sf * sf, 0) / N + eps)
    tl.store(rstd_ptr + row, rstd)
    h = (sf * rstd).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = w.to(tl.float32) * h.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _weighted_sum_tile(x_ptr, res_ptr, w_ptr, tok, run, offs_k, k_mask, stride_x, stride_r,
                       HAS_ADD: tl.constexpr):
    """w * (x + res) of the rows in `run`, [BLOCK_M, BLOCK_K] float32, the sum rounded to
    the residual's dtype as the norm rounds it."""
    m = run[:, None] & k_mask[None, :]
    s = tl.load(res_ptr + tok[:, None] * stride_r + offs_k[None, :], mask=m, other=0.0)
    if HAS_ADD:
        x = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=m, other=0.0)
        s = (x.to(tl.float32) + s.to(tl.float32)).to(res_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    return w[None, :] * s.to(tl.float32)


@triton.jit
def _shrink_block(x_ptr, res_ptr, w_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, T, N, R,
                  SR, k_chunk, stride_x, stride_r,
                  stride_al, stride_as, stride_ar, stride_ak,
                  stride_hk, stride_hs, stride_ht, stride_hr,
                  HAS_ADD: tl.constexpr, HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SR: tl.constexpr,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Shrink program q = (row block, K chunk): its unscaled split-K partials in hp."""
    ks, tok, _, left = block_program(slots_ptr, q, T, SPLIT_K, BLOCK_M)
    k_lo, k_hi = k_bounds(ks, k_chunk, N)
    cols = tl.arange(0, BLOCK_SR)          # column c: slice c // R, rank column c % R
    col_s = cols // R
    col_r = cols % R
    c_in = cols < SR
    h_ptrs = (hp_ptr + ks * stride_hk + col_s[None, :] * stride_hs + tok[:, None] * stride_ht
              + col_r[None, :] * stride_hr)
    slot = tl.max(left, axis=0)
    while slot >= 0:           # one pass per adapter in the block (one when uniform)
        run = left == slot
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        a_cols = (a_ptr + slot.to(tl.int64) * stride_al + col_s * stride_as
                  + col_r * stride_ar)
        a_mask = c_in & (col_r < rank)
        acc = tl.zeros([BLOCK_M, BLOCK_SR], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            u = _weighted_sum_tile(x_ptr, res_ptr, w_ptr, tok, run, offs_k, k_mask,
                                   stride_x, stride_r, HAS_ADD)
            at = tl.load(a_cols[None, :] + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & a_mask[None, :], other=0.0)
            acc += dot_f32(u.to(at.dtype), at, PRECISION, UPCAST)
        tl.store(h_ptrs, acc, mask=run[:, None] & c_in[None, :])
        left = tl.where(run, -1, left)
        slot = tl.max(left, axis=0)


@triton.jit
def _shrink_row(x_ptr, res_ptr, w_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, N, R, SR,
                k_chunk, stride_x, stride_r, stride_al, stride_as, stride_ar, stride_ak,
                stride_hk, stride_hs, stride_ht, stride_hr,
                HAS_ADD: tl.constexpr, HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_SR: tl.constexpr):
    """Shrink program q = (row, K chunk) of a mixed batch: the row's unscaled split-K
    partials in hp, a vector product on its own adapter's A (rows of distinct adapters
    gain nothing from a matrix product; a block of them would take one pass each)."""
    ks, t, slot = row_program(slots_ptr, q, SPLIT_K)
    if slot >= 0:
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        cols = tl.arange(0, BLOCK_SR)
        col_s = cols // R
        col_r = cols % R
        c_in = cols < SR
        a_cols = a_ptr + slot.to(tl.int64) * stride_al + col_s * stride_as + col_r * stride_ar
        a_mask = c_in & (col_r < rank)
        k_lo, k_hi = k_bounds(ks, k_chunk, N)
        acc = tl.zeros([BLOCK_SR], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            s = tl.load(res_ptr + t * stride_r + offs_k, mask=k_mask, other=0.0)
            if HAS_ADD:
                x = tl.load(x_ptr + t * stride_x + offs_k, mask=k_mask, other=0.0)
                s = (x.to(tl.float32) + s.to(tl.float32)).to(res_ptr.dtype.element_ty)
            u = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32) * s.to(tl.float32)
            at = tl.load(a_cols[None, :] + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & a_mask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(at * u[:, None], axis=0)
        tl.store(hp_ptr + ks * stride_hk + col_s * stride_hs + t * stride_ht
                 + col_r * stride_hr, acc, mask=c_in)


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def add_rms_norm_shrink_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr,
                               a_ptr, hp_ptr, slots_ptr, ranks_ptr,
                               T, N, R, SR, k_chunk, eps,
                               stride_x, stride_r, stride_o, stride_ro,
                               stride_al, stride_as, stride_ar, stride_ak,
                               stride_hk, stride_hs, stride_ht, stride_hr,
                               HAS_ADD: tl.constexpr, HAS_RANKS: tl.constexpr,
                               SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                               BLOCK_SR: tl.constexpr, PER_ROW: tl.constexpr,
                               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (T + cdiv(T, BLOCK_M) * SPLIT_K,), PER_ROW (T + T * SPLIT_K,): program p < T
    normalises row p; the others shrink (see the module docstring), PER_ROW one row each.
    HAS_ADD False: no x, the residual is normed as it is (the first layer) and res_out is
    not written."""
    pid = tl.program_id(0)
    if pid < T:
        _norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, pid.to(tl.int64), N,
                  stride_x, stride_r, stride_o, stride_ro, eps, HAS_ADD, BLOCK)
    elif PER_ROW:
        _shrink_row(x_ptr, res_ptr, w_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, pid - T, N, R,
                    SR, k_chunk, stride_x, stride_r, stride_al, stride_as, stride_ar,
                    stride_ak, stride_hk, stride_hs, stride_ht, stride_hr,
                    HAS_ADD, HAS_RANKS, SPLIT_K, BLOCK_K, BLOCK_SR)
    else:
        _shrink_block(x_ptr, res_ptr, w_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, pid - T,
                      T, N, R, SR, k_chunk, stride_x, stride_r,
                      stride_al, stride_as, stride_ar, stride_ak,
                      stride_hk, stride_hs, stride_ht, stride_hr,
                      HAS_ADD, HAS_RANKS, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_SR, PRECISION,
                      UPCAST)
