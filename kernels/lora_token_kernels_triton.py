"""Triton programs for multi-adapter LoRA on small (decode) batches, sized by tokens.

Host wrappers: kernels/lora_token_triton.py. The grid is (token groups, GROUP, ...) over
the step's tokens in slot-sorted order (`LoRAMeta.sorted_tokens` / `sorted_slots`), with
GROUP = 16, 32 or 64 chosen from the token count. Each group is done at the coarsest level
whose tokens all share one slot, so an adapter's A/B tile is read once per level block:

- the whole group (GROUP rows, e.g. one adapter for the whole batch): one matrix product;
- else each sub-group of SUB = 16 consecutive sorted tokens that share one slot: one
  16-row matrix product (runs of requests on one adapter);
- else one program per token with a vector product on its own slot's weights.

The shrink writes split-K partial sums hp [SPLIT_K, S, T, R] (float32, plain stores, no
zeroed buffer, no atomics); the expand adds the SPLIT_K partials up when it reads h. The
expand's programs loop over output tiles: the GROUP (or SUB) programs of a uniform block
share its tiles out between them, so no program of the grid is idle by construction, and
a per-token program walks every N_CHUNKS-th tile of its slice.
Tokens without a slot (-1, sorted last) are skipped by both kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.fused_shrink_kernels_triton import rank_of
from kernels.lora_kernels_triton import _expand_tile, _shrink_tile, _slice_bounds

SUB: tl.constexpr = tl.constexpr(16)


@triton.jit
def _blocks(sorted_slots_ptr, T, GROUP: tl.constexpr):
    """This program's group and sub-group: bounds (inclusive), first slots, uniformity."""
    first = tl.program_id(0) * GROUP
    last = tl.minimum(first + GROUP, T) - 1
    slot0 = tl.load(sorted_slots_ptr + first)
    big = (slot0 == tl.load(sorted_slots_ptr + last)) & (last > first)
    sfirst = tl.minimum(first + (tl.program_id(1) // SUB) * SUB, last)
    slast = tl.minimum(sfirst + SUB, last + 1) - 1
    sslot = tl.load(sorted_slots_ptr + sfirst)
    sub = (sslot == tl.load(sorted_slots_ptr + slast)) & (slast > sfirst)
    return first, last, slot0, big, sfirst, slast, sslot, sub


@triton.jit
def _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, row0, last, slot, s, R,
                 k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                 stride_ht, stride_hr, HAS_RANKS: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """hp rows of sorted positions row0..last (one slot): one ROWS-row matrix product."""
    rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
    offs_m = row0 + tl.arange(0, ROWS)
    m_mask = offs_m <= last
    tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    acc = _shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, k_lo, k_hi,
                       stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                       stride_ak, ROWS, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
    offs_r = tl.arange(0, BLOCK_R)
    tl.store(h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
             mask=m_mask[:, None] & (offs_r < R)[None, :])


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def lora_shrink_tok_kernel(x_ptr, a_ptr, hp_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           T, K, R,
                           stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_KG: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * SPLIT_K):
    hp[ks, s, tok, :] = x[tok, K range ks] @ a[slot(tok), s, :, K range ks].T."""
    s = tl.program_id(2) // SPLIT_K
    ks = tl.program_id(2) % SPLIT_K
    j = tl.program_id(1)
    first, last, slot0, big, sfirst, slast, sslot, sub = _blocks(sorted_slots_ptr, T, GROUP)
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    h_base = hp_ptr + ks * stride_hk + s * stride_hs
    if big:
        if (j == 0) & (slot0 >= 0):
            _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, first, last, slot0, s, R,
                         k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                         stride_ak, stride_ht, stride_hr, HAS_RANKS, GROUP, BLOCK_R, BLOCK_KG,
                         PRECISION, UPCAST)
    elif sub:
        if (j % SUB == 0) & (sslot >= 0):
            _shrink_rows(x_ptr, a_ptr, h_base, sorted_ptr, ranks_ptr, sfirst, slast, sslot, s,
                         R, k_lo, k_hi, stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                         stride_ak, stride_ht, stride_hr, HAS_RANKS, SUB, BLOCK_R, BLOCK_K,
                         PRECISION, UPCAST)
    else:
        p = first + j
        slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
        if (p <= last) & (slot >= 0):
            rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
            tok = tl.load(sorted_ptr + p).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            a_base = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_mask = offs_k < k_hi
                xv = tl.load(x_ptr + tok * stride_xt + offs_k * stride_xk, mask=k_mask,
                             other=0.0).to(tl.float32)
                at = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :] * stride_ak,
                             mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                acc += tl.sum(at * xv[None, :], axis=1)
            tl.store(h_base + tok * stride_ht + offs_r * stride_hr, acc, mask=offs_r < R)


@triton.jit
def _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, row0, last, slot,
                 R, lo, hi, u0, u_step, h_base, stride_hk, stride_ht, stride_hr,
                 stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                 HAS_RANKS: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """y rows of sorted positions row0..last (one slot) += h @ B.T over the slice's
    BLOCK_N tiles u0, u0 + u_step, ... (h summed over the split-K partials once, then
    with HAS_SCALE each row times scale[tok])."""
    n_tiles = tl.cdiv(hi - lo, BLOCK_N)
    if u0 < n_tiles:
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        offs_m = row0 + tl.arange(0, ROWS)
        m_mask = offs_m <= last
        tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = tl.arange(0, BLOCK_R)
        h_mask = m_mask[:, None] & (offs_r < rank)[None, :]
        h_ptrs = h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
        h = tl.zeros([ROWS, BLOCK_R], dtype=tl.float32)
        for ks in tl.static_range(SPLIT_K):
            h += tl.load(h_ptrs + ks * stride_hk, mask=h_mask, other=0.0)
        if HAS_SCALE:
            h = h * tl.load(scale_ptr + tok, mask=m_mask, other=0.0)[:, None]
        for i in range(0, tl.cdiv(n_tiles - u0, u_step)):   # (a tensor step: not in range)
            _expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank,
                         lo + (u0 + i * u_step) * BLOCK_N, hi,
                         stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                         BLOCK_R, BLOCK_N, PRECISION, UPCAST)


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def lora_expand_tok_kernel(hp_ptr, b_ptr, y_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           scale_ptr, T, R, n_chunks, o0, o1, o2, o3, o4,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                           HAS_RANKS: tl.constexpr, HAS_SCALE: tl.constexpr,
                           SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_NG: tl.constexpr, PRECISION: tl.constexpr,
                           UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * n_chunks):
    y[tok, slice s] += (sum_ks hp[ks, s, tok]) @ b[slot(tok), slice s].T, with HAS_SCALE
    the sum times scale[tok] first (a row factor the shrink could not apply: the 1/rms of
    kernels/norm_shrink_kernels_triton.py).

    Lane (j, c) of a uniform block of LANES programs takes tiles j * n_chunks + c, stepping
    by LANES * n_chunks; a per-token program takes tiles c, c + n_chunks, ..."""
    s = tl.program_id(2) // n_chunks
    c = tl.program_id(2) % n_chunks
    j = tl.program_id(1)
    lo, hi = _slice_bounds(s, o0, o1, o2, o3, o4)
    first, last, slot0, big, sfirst, slast, sslot, sub = _blocks(sorted_slots_ptr, T, GROUP)
    h_base = hp_ptr + s * stride_hs
    if big:
        if slot0 >= 0:
            _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, first, last,
                         slot0, R, lo, hi, j * n_chunks + c, GROUP * n_chunks, h_base,
                         stride_hk, stride_ht, stride_hr, stride_bl, stride_bn, stride_br,
                         stride_yt, stride_yn, HAS_RANKS, HAS_SCALE, SPLIT_K, GROUP, BLOCK_R,
                         BLOCK_NG, PRECISION, UPCAST)
    elif sub:
        if sslot >= 0:
            _expand_rows(hp_ptr, b_ptr, y_ptr, sorted_ptr, ranks_ptr, scale_ptr, sfirst, slast,
                         sslot, R, lo, hi, (j % SUB) * n_chunks + c, SUB * n_chunks, h_base,
                         stride_hk, stride_ht, stride_hr, stride_bl, stride_bn, stride_br,
                         stride_yt, stride_yn, HAS_RANKS, HAS_SCALE, SPLIT_K, SUB, BLOCK_R,
                         BLOCK_N, PRECISION, UPCAST)
    else:
        p = first + j
        slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
        if (p <= last) & (slot >= 0):
            rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
            tok = tl.load(sorted_ptr + p).to(tl.int64)
            offs_r = tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            h = tl.zeros([BLOCK_R], dtype=tl.float32)
            for ks in tl.static_range(SPLIT_K):
                h += tl.load(h_base + ks * stride_hk + tok * stride_ht + offs_r * stride_hr,
                             mask=r_mask, other=0.0)
            if HAS_SCALE:
                h = h * tl.load(scale_ptr + tok)
            b_base = b_ptr + slot.to(tl.int64) * stride_bl
            for i in range(0, tl.cdiv(tl.cdiv(hi - lo, BLOCK_N) - c, n_chunks)):
                offs_n = lo + (c + i * n_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
                n_mask = offs_n < hi
                bt = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                             mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
                delta = tl.sum(bt * h[None, :], axis=1)
                y_ptrs = y_ptr + tok * stride_yt + offs_n * stride_yn
                yv = tl.load(y_ptrs, mask=n_mask, other=0.0)
                tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n_mask)
