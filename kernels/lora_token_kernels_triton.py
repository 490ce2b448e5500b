"""Triton programs for multi-adapter LoRA on small (decode) batches, sized by tokens.

Host wrappers: kernels/lora_token_triton.py. The segment kernels (lora_kernels_triton.py)
size their grids by adapter slots and pad every segment to a row block; in a decode batch
most segments are one token, so that wastes programs and rows. Here the grid is
(token groups, GROUP, ...) over the step's tokens in slot-sorted order
(`LoRAMeta.sorted_tokens` / `sorted_slots`):

- a group of GROUP consecutive sorted tokens that all share one slot ("uniform", e.g. one
  adapter for the whole batch) is done by its first program with one matrix product, so the
  adapter's A/B tile is loaded once for the group; the other GROUP-1 programs return;
- otherwise every program takes one token and does a vector product with its own slot's
  weights (no 16-row padding for one-token segments).

The shrink writes split-K partial sums hp [SPLIT_K, S, T, R] (float32, plain stores, no
zeroed buffer and no atomics); the expand adds the SPLIT_K partials up when it reads h.
Tokens without a slot (-1, sorted last) are skipped by both kernels.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.lora_kernels_triton import _expand_tile, _shrink_tile, _slice_bounds


@triton.jit
def _group(sorted_slots_ptr, T, GROUP: tl.constexpr):
    """First/last sorted position of this program's group and whether it is uniform."""
    first = tl.program_id(0) * GROUP
    last = tl.minimum(first + GROUP, T) - 1
    slot0 = tl.load(sorted_slots_ptr + first)
    uniform = (slot0 == tl.load(sorted_slots_ptr + last)) & (last > first)
    return first, last, slot0, uniform


@triton.jit
def _rank_of(ranks_ptr, slot, R, HAS_RANKS: tl.constexpr):
    if HAS_RANKS:
        return tl.load(ranks_ptr + slot)
    return R


@triton.jit
def lora_shrink_tok_kernel(x_ptr, a_ptr, hp_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           T, K, R,
                           stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * SPLIT_K):
    hp[ks, s, tok, :] = x[tok, K range ks] @ a[slot(tok), s, :, K range ks].T."""
    s = tl.program_id(2) // SPLIT_K
    ks = tl.program_id(2) % SPLIT_K
    first, last, slot0, uniform = _group(sorted_slots_ptr, T, GROUP)
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    offs_r = tl.arange(0, BLOCK_R)
    h_base = hp_ptr + ks * stride_hk + s * stride_hs
    if uniform:
        if (tl.program_id(1) == 0) & (slot0 >= 0):
            rank = _rank_of(ranks_ptr, slot0, R, HAS_RANKS)
            offs_m = first + tl.arange(0, GROUP)
            m_mask = offs_m <= last
            tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
            acc = _shrink_tile(x_ptr, a_ptr, tok, m_mask, slot0, s, rank, k_lo, k_hi,
                               stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                               stride_ak, GROUP, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
            tl.store(h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
                     mask=m_mask[:, None] & (offs_r < R)[None, :])
    else:
        p = first + tl.program_id(1)
        slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
        if (p <= last) & (slot >= 0):
            rank = _rank_of(ranks_ptr, slot, R, HAS_RANKS)
            tok = tl.load(sorted_ptr + p).to(tl.int64)
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
def lora_expand_tok_kernel(hp_ptr, b_ptr, y_ptr, sorted_ptr, sorted_slots_ptr, ranks_ptr,
                           T, R, n_blocks, o0, o1, o2, o3, o4,
                           stride_hk, stride_hs, stride_ht, stride_hr,
                           stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                           HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                           GROUP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(T, GROUP), min(GROUP, T), S * n_blocks):
    y[tok, n tile of slice s] += (sum_ks hp[ks, s, tok]) @ b[slot(tok), n tile].T."""
    s = tl.program_id(2) // n_blocks
    lo, hi = _slice_bounds(s, o0, o1, o2, o3, o4)
    n0 = lo + (tl.program_id(2) % n_blocks) * BLOCK_N
    first, last, slot0, uniform = _group(sorted_slots_ptr, T, GROUP)
    offs_r = tl.arange(0, BLOCK_R)
    h_base = hp_ptr + s * stride_hs
    if n0 < hi:
        if uniform:
            if (tl.program_id(1) == 0) & (slot0 >= 0):
                rank = _rank_of(ranks_ptr, slot0, R, HAS_RANKS)
                offs_m = first + tl.arange(0, GROUP)
                m_mask = offs_m <= last
                tok = tl.load(sorted_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
                h_mask = m_mask[:, None] & (offs_r < rank)[None, :]
                h_ptrs = h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
                h = tl.zeros([GROUP, BLOCK_R], dtype=tl.float32)
                for ks in tl.static_range(SPLIT_K):
                    h += tl.load(h_ptrs + ks * stride_hk, mask=h_mask, other=0.0)
                _expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot0, rank, n0, hi,
                             stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                             BLOCK_R, BLOCK_N, PRECISION, UPCAST)
        else:
            p = first + tl.program_id(1)
            slot = tl.load(sorted_slots_ptr + tl.minimum(p, last))
            if (p <= last) & (slot >= 0):
                rank = _rank_of(ranks_ptr, slot, R, HAS_RANKS)
                tok = tl.load(sorted_ptr + p).to(tl.int64)
                r_mask = offs_r < rank
                h = tl.zeros([BLOCK_R], dtype=tl.float32)
                for ks in tl.static_range(SPLIT_K):
                    h += tl.load(h_base + ks * stride_hk + tok * stride_ht + offs_r * stride_hr,
                                 mask=r_mask, other=0.0)
                offs_n = n0 + tl.arange(0, BLOCK_N)
                n_mask = offs_n < hi
                bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[:, None] * stride_bn
                             + offs_r[None, :] * stride_br,
                             mask=n_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
                delta = tl.sum(bt * h[None, :], axis=1)
                y_ptrs = y_ptr + tok * stride_yt + offs_n * stride_yn
                yv = tl.load(y_ptrs, mask=n_mask, other=0.0)
                tl.store(y_ptrs, (yv.to(tl.float32) + delta).to(yv.dtype), mask=n_mask)
