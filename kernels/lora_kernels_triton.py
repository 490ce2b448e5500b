"""Triton programs for batched multi-adapter LoRA (host wrappers: kernels/lora_triton.py):
the row-block segment kernels (the prefill path before the tile list, kept selectable:
`lora_triton.SEGMENT_TILE_LIST`) and the single-launch kernel for small batches. (The
prefill path's tile-list programs are in kernels/lora_segment_kernels_triton.py, the
decode path's in lora_token_kernels_triton.py.)

Every program works on one *segment*: the run of tokens that share an adapter slot, in
the order `LoRAMeta.sorted_tokens` lists them. Axis 2 of every grid walks the compacted
list of active slots (`active_slots`, padded with -1); programs past the end, or past
their segment's length, return at once. Grids are therefore sized from static shapes
only (token count, slot count), which keeps the launches capturable by CUDA graphs.

Weights: a [L, S, R, K], b [L, N, R]; the intermediate h [S, T, R] is float32.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.dot_triton import dot_f32




@triton.jit
def _segment(active_ptr, seg_start_ptr, seg_len_ptr, ranks_ptr, i, R,
             HAS_RANKS: tl.constexpr):
    """Slot, segment start/length and real rank of active entry i (slot -1 = none)."""
    slot = tl.load(active_ptr + i)
    seg_start = tl.load(seg_start_ptr + i)
    seg_len = tl.load(seg_len_ptr + i)
    if HAS_RANKS:
        rank = tl.load(ranks_ptr + tl.maximum(slot, 0))
    else:
        rank = R
    return slot, seg_start, seg_len, rank


@triton.jit
def _slice_bounds(s, o0, o1, o2, o3, o4):
    """Output rows [lo, hi) of slice s (at most four slices)."""
    lo = tl.where(s == 0, o0, tl.where(s == 1, o1, tl.where(s == 2, o2, o3)))
    hi = tl.where(s == 0, o1, tl.where(s == 1, o2, tl.where(s == 2, o3, o4)))
    return lo, hi


@triton.jit
def _shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, k_lo, k_hi,
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
def _expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank, n0, hi,
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


@triton.jit
def lora_shrink_kernel(x_ptr, a_ptr, h_ptr, sorted_ptr, seg_start_ptr, seg_len_ptr,
                       active_ptr, ranks_ptr, K, R,
                       stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                       stride_hs, stride_ht, stride_hr,
                       HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (m-blocks, S * SPLIT_K, active entries): h[s, tok, :] = x[tok] @ a[slot, s].T.

    With SPLIT_K > 1 each program sums one K range and adds atomically into a zeroed h."""
    pid_m = tl.program_id(0)
    s = tl.program_id(1) // SPLIT_K
    ks = tl.program_id(1) % SPLIT_K
    slot, seg_start, seg_len, rank = _segment(active_ptr, seg_start_ptr, seg_len_ptr,
                                              ranks_ptr, tl.program_id(2), R, HAS_RANKS)
    if (slot < 0) | (pid_m * BLOCK_M >= seg_len):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    k_chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    acc = _shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, k_lo, k_hi,
                       stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                       BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
    offs_r = tl.arange(0, BLOCK_R)
    h_ptrs = h_ptr + s * stride_hs + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
    mask = m_mask[:, None] & (offs_r < R)[None, :]
    if SPLIT_K == 1:
        tl.store(h_ptrs, acc, mask=mask)
    else:
        tl.atomic_add(h_ptrs, acc, mask=mask)


@triton.jit
def lora_expand_kernel(h_ptr, b_ptr, y_ptr, sorted_ptr, seg_start_ptr, seg_len_ptr,
                       active_ptr, ranks_ptr, R, n_blocks, o0, o1, o2, o3, o4,
                       stride_hs, stride_ht, stride_hr, stride_bl, stride_bn, stride_br,
                       stride_yt, stride_yn,
                       HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST: tl.constexpr):
    """Grid (m-blocks, S * n_blocks, active entries): y[tok, slice s] += h[s, tok] @ b.T."""
    pid_m = tl.program_id(0)
    s = tl.program_id(1) // n_blocks
    lo, hi = _slice_bounds(s, o0, o1, o2, o3, o4)
    n0 = lo + (tl.program_id(1) % n_blocks) * BLOCK_N
    slot, seg_start, seg_len, rank = _segment(active_ptr, seg_start_ptr, seg_len_ptr,
                                              ranks_ptr, tl.program_id(2), R, HAS_RANKS)
    if (slot < 0) | (pid_m * BLOCK_M >= seg_len) | (n0 >= hi):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + s * stride_hs + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                mask=m_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
    _expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank, n0, hi,
                 stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                 BLOCK_R, BLOCK_N, PRECISION, UPCAST)


@triton.jit
def lora_fused_kernel(x_ptr, a_ptr, b_ptr, y_ptr, sorted_ptr, seg_start_ptr, seg_len_ptr,
                      active_ptr, ranks_ptr, K, R, o0, o1, o2, o3, o4, N_SPLIT,
                      stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                      stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                      HAS_RANKS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One launch for small batches (every segment fits BLOCK_M rows).

    Grid (active entries, S, N_SPLIT): each program computes its segment's h for slice s in
    registers (A read once per program) and adds h @ B.T into its 1/N_SPLIT of the slice."""
    s = tl.program_id(1)
    ns = tl.program_id(2)
    slot, seg_start, seg_len, rank = _segment(active_ptr, seg_start_ptr, seg_len_ptr,
                                              ranks_ptr, tl.program_id(0), R, HAS_RANKS)
    if slot < 0:
        return
    lo, hi = _slice_bounds(s, o0, o1, o2, o3, o4)
    n_chunk = tl.cdiv(tl.cdiv(hi - lo, N_SPLIT), BLOCK_N) * BLOCK_N
    n_lo = lo + ns * n_chunk
    n_hi = tl.minimum(hi, n_lo + n_chunk)
    if n_lo >= n_hi:
        return
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < seg_len
    tok = tl.load(sorted_ptr + seg_start + offs_m, mask=m_mask, other=0).to(tl.int64)
    h = _shrink_tile(x_ptr, a_ptr, tok, m_mask, slot, s, rank, 0, K,
                     stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                     BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        _expand_tile(h, b_ptr, y_ptr, tok, m_mask, slot, rank, n0, n_hi,
                     stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                     BLOCK_R, BLOCK_N, PRECISION, UPCAST)
