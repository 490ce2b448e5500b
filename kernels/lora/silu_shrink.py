"""The SiLU-and-multiply + LoRA shrink in one launch (program and launch);
`loramux_kernels.lora.norm_shrink.expand_fused_shrunk` finishes it. Reference:
kernels/lora/reference.py silu_mul_shrink_ref. The grid comes from static sizes only (tokens, K), so the launch is
capturable in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32
from loramux_kernels.lora.norm_shrink import (BLOCK_M, MAX_TOKENS, FusedShrunk, default_block_k,
                                      split_k)
from loramux_kernels.lora.token import _block_r
from loramux_kernels.lora.tiles import block_program, k_bounds, rank_of, row_program


# ---- the programs ----------------------------------------------------------------------
# SiLU-and-multiply + LoRA shrink in one Triton launch (its launch: below): the MLP's activation, whose output is down_proj's input,
# also starts down's LoRA shrink, so that shrink has no launch of its own and does not read
# the activation back.
#
# Program (rows, K chunk) writes its chunk of h = silu(gate) * up, rounded as
# silu_mul_kernel (kernels/elementwise_kernels_triton.py), and the split-K partials of the
# shrink of that chunk, hp[ks, 0, t, :] = h[t, K chunk] @ A[slot(t), 0, :, K chunk].T. The
# activation needs nothing from outside its chunk, so the K chunks of the shrink are the
# activation's own column blocks. Rows: a BLOCK_M block in batch order (a matrix product per
# adapter in the block: one when the rows share one; h is written in a sweep of its own
# first, so rows without an adapter get theirs too), or with PER_ROW one row per program
# (a vector product on the row's adapter: mixed batches). Rows without an adapter (slot -1)
# get no partials and are never read.


@triton.jit
def _silu_mul(gate_ptrs, mask, I, dt: tl.constexpr):
    """silu(gate) * up where x = [gate | up] and gate_ptrs point into gate (any shape), in
    dtype dt, rounded as silu_mul_kernel rounds."""
    g = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_ptrs + I, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    return (s * u).to(dt)


@triton.jit
def _block(x_ptr, out_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, T, I, R, k_chunk,
           stride_x, stride_o, stride_al, stride_ar, stride_ak, stride_hk, stride_ht,
           stride_hr, HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program q = (row block, K chunk)."""
    dt = out_ptr.dtype.element_ty
    ks, tok, in_t, left = block_program(slots_ptr, q, T, SPLIT_K, BLOCK_M)
    k_lo, k_hi = k_bounds(ks, k_chunk, I)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        m = in_t[:, None] & k_mask[None, :]
        h = _silu_mul(x_ptr + tok[:, None] * stride_x + offs_k[None, :], m, I, dt)
        tl.store(out_ptr + tok[:, None] * stride_o + offs_k[None, :], h, mask=m)
    offs_r = tl.arange(0, BLOCK_R)
    slot = tl.max(left, axis=0)
    while slot >= 0:           # one pass per adapter in the block (one when uniform)
        run = left == slot
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        a_base = a_ptr + slot.to(tl.int64) * stride_al + offs_r[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            h = _silu_mul(x_ptr + tok[:, None] * stride_x + offs_k[None, :],
                          run[:, None] & k_mask[None, :], I, dt)
            at = tl.load(a_base + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
            acc += dot_f32(h.to(at.dtype), at, PRECISION, UPCAST)
        tl.store(hp_ptr + ks * stride_hk + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr,
                 acc, mask=run[:, None] & (offs_r < R)[None, :])
        left = tl.where(run, -1, left)
        slot = tl.max(left, axis=0)


@triton.jit
def _row(x_ptr, out_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, I, R, k_chunk,
         stride_x, stride_o, stride_al, stride_ar, stride_ak, stride_hk, stride_ht,
         stride_hr, HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr,
         BLOCK_R: tl.constexpr):
    """Program q = (row, K chunk) of a mixed batch."""
    dt = out_ptr.dtype.element_ty
    ks, t, slot = row_program(slots_ptr, q, SPLIT_K)
    # no adapter: no A read, partials unused
    rank = tl.where(slot >= 0, rank_of(ranks_ptr, tl.maximum(slot, 0), R, HAS_RANKS), 0)
    offs_r = tl.arange(0, BLOCK_R)
    a_base = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al + offs_r[None, :] * stride_ar
    k_lo, k_hi = k_bounds(ks, k_chunk, I)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        h = _silu_mul(x_ptr + t * stride_x + offs_k, k_mask, I, dt)
        tl.store(out_ptr + t * stride_o + offs_k, h, mask=k_mask)
        at = tl.load(a_base + offs_k[:, None] * stride_ak,
                     mask=k_mask[:, None] & (offs_r < rank)[None, :], other=0.0)
        acc += tl.sum(at.to(tl.float32) * h.to(tl.float32)[:, None], axis=0)
    if slot >= 0:
        tl.store(hp_ptr + ks * stride_hk + t * stride_ht + offs_r * stride_hr, acc,
                 mask=offs_r < R)


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def silu_mul_shrink_kernel(x_ptr, out_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr,
                           T, I, R, k_chunk, stride_x, stride_o,
                           stride_al, stride_ar, stride_ak, stride_hk, stride_ht, stride_hr,
                           HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_R: tl.constexpr, PER_ROW: tl.constexpr,
                           PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (cdiv(T, BLOCK_M) * SPLIT_K,), PER_ROW (T * SPLIT_K,): out [T, I] =
    silu(gate) * up of x = [gate | up] [T, 2I], and hp's split-K partials of out @ A.T
    (one slice: a [L, 1, R, I], hp [SPLIT_K, 1, T, R] float32)."""
    q = tl.program_id(0)
    if PER_ROW:
        _row(x_ptr, out_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, I, R, k_chunk,
             stride_x, stride_o, stride_al, stride_ar, stride_ak, stride_hk, stride_ht,
             stride_hr, HAS_RANKS, SPLIT_K, BLOCK_K, BLOCK_R)
    else:
        _block(x_ptr, out_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, q, T, I, R, k_chunk,
               stride_x, stride_o, stride_al, stride_ar, stride_ak, stride_hk, stride_ht,
               stride_hr, HAS_RANKS, SPLIT_K, BLOCK_M, BLOCK_K, BLOCK_R, PRECISION, UPCAST)


# ---- their launches --------------------------------------------------------------------

def silu_mul_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                    slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                    uniform: bool = False, splits: int | None = None,
                    block_k: int | None = None, num_warps: int = 4
                    ) -> tuple[torch.Tensor, FusedShrunk]:
    """(silu(gate) * up, the LoRA shrink of it) in one launch, x = [gate | up] [T, 2I]
    (rows contiguous); a [L, 1, R, I] (one slice: down_proj); token_slots [T] (-1: no
    adapter); slice_offsets (0, N) of the expand's output; ranks [L] int32 or None (then
    R); uniform: a hint that the rows share one adapter (BLOCK_M-row matrix products;
    otherwise one row per program: the result is the same); splits, block_k, num_warps:
    launch parameters (defaults as kernels/lora/norm_shrink.py)."""
    T, two_i = x.shape
    L, S, R, I = a.shape
    assert 0 < T <= MAX_TOKENS and S == 1 and two_i == 2 * I and x.stride(-1) == 1, \
        (T, S, two_i, I)
    assert token_slots.shape == (T,) and len(slice_offsets) == 2
    splits = splits or split_k(T, 1, I, uniform)
    block_r = _block_r(R)
    block_k = block_k or default_block_k(block_r, triton.cdiv(I, splits), not uniform)
    k_chunk = triton.cdiv(triton.cdiv(I, splits), block_k) * block_k
    splits = triton.cdiv(I, k_chunk)                 # no empty chunk
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    hp = torch.empty((splits, 1, T, R), dtype=torch.float32, device=x.device)
    grid = ((triton.cdiv(T, BLOCK_M) if uniform else T) * splits,)
    silu_mul_shrink_kernel[grid](
        x, out, a, hp, token_slots, ranks if ranks is not None else token_slots,
        T, I, R, k_chunk, x.stride(0), out.stride(0), a.stride(0), a.stride(2), a.stride(3),
        hp.stride(0), hp.stride(2), hp.stride(3),
        HAS_RANKS=ranks is not None, SPLIT_K=splits, BLOCK_M=BLOCK_M, BLOCK_K=block_k,
        BLOCK_R=block_r, PER_ROW=not uniform,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type == "cpu", num_warps=num_warps)
    shrunk = FusedShrunk(hp, None, tuple(int(o) for o in slice_offsets), ranks, uniform)
    return out, shrunk
