"""The @triton.jit pieces the LoRA programs share, inlined where called: a slice's output
rows (`slice_bounds`), one tile of the shrink x·Aᵀ and of the expand h·Bᵀ (`shrink_tile`,
`expand_tile`: the token and mixed programs), an adapter's real rank (`rank_of`), and
where a fused split-K shrink program stands (its row block or row, its K chunk:
kernels/lora/norm_shrink.py, silu_shrink.py)."""
from __future__ import annotations

import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32


@triton.jit
def block_program(slots_ptr, q, T, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program q = (row block, K chunk): the chunk index, the block's token indices
    (int64), which of them are inside T, and their slots (-1 past T)."""
    mb = q // SPLIT_K
    tok = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = tok < T
    slots = tl.load(slots_ptr + tok, mask=in_t, other=-1).to(tl.int32)
    return q % SPLIT_K, tok.to(tl.int64), in_t, slots


@triton.jit
def row_program(slots_ptr, q, SPLIT_K: tl.constexpr):
    """Program q = (row, K chunk) of a mixed batch: the chunk index, the row (int64) and
    its slot (-1: no adapter)."""
    t = (q // SPLIT_K).to(tl.int64)
    return q % SPLIT_K, t, tl.load(slots_ptr + t).to(tl.int32)


@triton.jit
def k_bounds(ks, k_chunk, K):
    """Columns [k_lo, k_hi) of K chunk ks (the last chunk may be short)."""
    k_lo = ks * k_chunk
    return k_lo, tl.minimum(K, k_lo + k_chunk)


@triton.jit
def rank_of(ranks_ptr, slot, R, HAS_RANKS: tl.constexpr):
    """The real rank of adapter `slot` (>= 0): its entry in ranks, or the pool's R for
    all when there is no ranks tensor."""
    if HAS_RANKS:
        return tl.load(ranks_ptr + slot)
    return R


@triton.jit
def slice_bounds(s, o0, o1, o2, o3, o4):
    """Output rows [lo, hi) of slice s (at most four slices)."""
    lo = tl.where(s == 0, o0, tl.where(s == 1, o1, tl.where(s == 2, o2, o3)))
    hi = tl.where(s == 0, o1, tl.where(s == 1, o2, tl.where(s == 2, o3, o4)))
    return lo, hi


@triton.jit
def shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, k_lo, k_hi,
                 stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                 BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc[m, r] = sum_{k in [k_lo, k_hi)} x[tok[m], k] * a[slot, s, r, k], float32.

    Rows past `rank` are masked, so a low-rank slot reads only its own weights."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank
    a_base = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xt = tl.load(x_ptr + tok[:, None] * stride_xt + offs_k[None, :] * stride_xk,
                     mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_r[None, :] * stride_ar + offs_k[:, None] * stride_ak,
                     mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        acc += dot_f32(xt.to(at.dtype), at, PRECISION, UPCAST)
    return acc


@triton.jit
def expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank, n0, hi,
                 stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                 BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """y[tok[m], n0:n0+BLOCK_N] += h[m, :rank] @ b[slot, n, :rank].T (clipped at hi)."""
    offs_r = tl.arange(0, BLOCK_R)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hi
    bt = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_n[None, :] * stride_bn
                 + offs_r[:, None] * stride_br,
                 mask=(offs_r < rank)[:, None] & n_mask[None, :], other=0.0)
    delta = dot_f32(h.to(bt.dtype), bt, PRECISION, UPCAST)
    y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :] * stride_yn
    mask = m_mask[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)
