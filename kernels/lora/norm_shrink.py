"""The add + RMSNorm + LoRA shrink in one launch (program and launch), and the expand
that finishes it or any shrink fused into the op that makes a group's input
(kernels/lora/silu_shrink.py too). Reference: kernels/lora/reference.py
add_rms_norm_shrink_ref.

`add_rms_norm_shrink` returns the norm's output, the new residual and a `FusedShrunk`
(unscaled split-K partials and each row's 1/rms); `expand_fused_shrunk` adds the LoRA
delta to the group's matmul output with the token-sized expand kernel
(kernels/lora/token.py), which scales each row's h by its 1/rms. Grids come from
static sizes only (tokens, slices, K), so both launches are capturable in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32
from loramux_kernels.lora.token import (_MAX_SLICES, _block_r, _offsets, default_split_k,
                                lora_expand_tokens)
from loramux_kernels.lora.tiles import block_program, k_bounds, rank_of, row_program


# ---- the programs ----------------------------------------------------------------------
# Residual add + RMSNorm + LoRA shrink in one Triton launch (its launch: below): a decoder layer's norm that makes the input of a LoRA
# group (q/k/v after the input norm, gate/up after the post-attention norm) also starts
# that group's shrink, so the shrink has no launch of its own and does not read the norm's
# output back.
#
# The 1-D grid has two roles, independent of each other:
#
# - programs [0, T): one row each, the add + RMSNorm of kernels/elementwise_kernels_triton.py
#   (same rounding), writing the new residual to its own tensor and the row's float32
#   1/rms to `rstd`;
# - programs [T, T + row blocks * SPLIT_K): (row block, K chunk): split-K partials of the
#   shrink of the *unscaled* normed rows, hp[ks, s, t, :] = (w * (x + res))[t, K chunk] @
#   A[slot(t), s, :, K chunk].T, all slices at once (slice and rank columns side by side,
#   S * R wide); with PER_ROW (mixed batches) one row per program instead of a block.
#   The row's 1/rms is a scalar of the whole row, which no K chunk knows; the expand
#   multiplies each row's summed h by it (lora_expand_tokens' row_scale).
#
# The shrink programs read x and the old residual while the norm programs run, so the new
# residual is never written in place. Rows are in batch order, BLOCK_M to a block (one
# adapter for all rows: A read once per block), each block done one adapter at a time
# (the largest slot among its rows not done yet, until only rows without an adapter, slot
# -1, are left: those get no partials and are never read). A block of one adapter is one
# matrix product.


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


# ---- their launches --------------------------------------------------------------------

MAX_TOKENS = 256           # the decode path (kernels/lora/launch.py TOKEN_PATH_MAX_TOKENS)
BLOCK_M = 16               # rows per shrink program (tl.dot needs 16)
_MIN_K_CHUNK = 128
_MIXED_PROGRAMS = 512      # one-row shrink programs wanted for a mixed batch (about four
                           # per SM: each reads its own adapter's A chunk)
_MAX_SPLIT_K = 32
MAX_FUSED_COLUMNS = 512    # S·R of one program's A tile (padded to a power of two): wider,
                           # a tl.dot block of it no longer fits shared memory (q/k/v at rank
                           # 256 in float32 asks 262 KB of sm_90's 227 KB); such groups take
                           # the plain op and the token shrink, which tiles one slice at a time


@dataclass(frozen=True)
class FusedShrunk:
    """What a shrink fused into the op before it leaves for `expand_fused_shrunk`."""
    hp: torch.Tensor              # [split_k, S, T, R] float32 partials (of unscaled rows)
    rstd: torch.Tensor | None     # [T] float32: 1/rms of each row, scales h in the expand
    slice_offsets: tuple[int, ...]
    ranks: torch.Tensor | None
    uniform: bool


def fits(slices: int, rank: int) -> bool:
    """Whether a group of `slices` slices of rank `rank` may run its shrink fused into
    the op before it (MAX_FUSED_COLUMNS)."""
    return _block_r(slices * rank) <= MAX_FUSED_COLUMNS


def split_k(T: int, S: int, Kdim: int, uniform: bool) -> int:
    """K chunks per row block. `uniform`: the token shrink's tuned split (the expand then
    sums as many partials as it does after that shrink); a mixed batch (one row per
    program): about _MIXED_PROGRAMS programs, a power of two (few compiled variants of the
    expand, which unrolls its sum over them)."""
    if uniform:
        return default_split_k(T, S, Kdim, uniform=True)
    want = -(-_MIXED_PROGRAMS // T)
    split = max(1, min(want, _MAX_SPLIT_K, Kdim // _MIN_K_CHUNK))
    return 1 << (split.bit_length() - 1)


def default_block_k(block_sr: int, k_chunk: int, per_row: bool) -> int:
    """An [BLOCK_K, BLOCK_SR] A tile of about 8K values for a one-row program, 4K beside
    a block's [BLOCK_M, BLOCK_K] rows of at most 2K (sm_90, bf16, 4 warps: q/k/v at rank
    16 125 and 207 registers, the SiLU block 155; 8K A values or 4K rows in a block
    program take all 255)."""
    if per_row:
        return max(32, min(256, 8192 // block_sr, triton.next_power_of_2(k_chunk)))
    return max(32, min(2048 // BLOCK_M, 4096 // block_sr, triton.next_power_of_2(k_chunk)))


def add_rms_norm_shrink(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, a: torch.Tensor, token_slots: torch.Tensor,
                        slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                        uniform: bool = False, splits: int | None = None,
                        block_k: int | None = None, num_warps: int = 4
                        ) -> tuple[torch.Tensor, torch.Tensor, FusedShrunk]:
    """(rms_norm(residual + x), residual + x, the LoRA shrink of the first) in one launch.

    x None: rms_norm(residual) and residual itself (nothing added). The new residual is a
    new tensor (the shrink programs read the old one meanwhile). x, residual [T, N]
    (rows contiguous); weight [N]; a [L, S, R, N]; token_slots [T] (-1: no adapter);
    ranks [L] int32 or None (then R); uniform: a hint that the rows share one adapter
    (BLOCK_M-row matrix products; otherwise one row per shrink program: the result is the
    same); splits, block_k, num_warps: launch parameters (defaults: `split_k`,
    `default_block_k`, 4 as the plain norm; against the separate launches:
    benchmarks/results/2026-11-27-h100/norm_shrink.txt)."""
    T, N = residual.shape
    L, S, R, Ka = a.shape
    assert 0 < T <= MAX_TOKENS and 0 < S <= _MAX_SLICES and Ka == N, (T, S, Ka, N)
    assert residual.stride(-1) == 1 and weight.shape == (N,) and weight.stride(0) == 1
    assert x is None or (x.shape == residual.shape and x.stride(-1) == 1)
    assert token_slots.shape == (T,) and len(slice_offsets) == S + 1
    splits = splits or split_k(T, S, N, uniform)
    block_sr = _block_r(S * R)
    block_k = block_k or default_block_k(block_sr, triton.cdiv(N, splits), not uniform)
    k_chunk = triton.cdiv(triton.cdiv(N, splits), block_k) * block_k
    splits = triton.cdiv(N, k_chunk)                 # no empty chunk
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual) if x is not None else residual
    rstd = torch.empty(T, dtype=torch.float32, device=residual.device)
    hp = torch.empty((splits, S, T, R), dtype=torch.float32, device=residual.device)
    grid = (T + (triton.cdiv(T, BLOCK_M) if uniform else T) * splits,)
    add_rms_norm_shrink_kernel[grid](
        x if x is not None else residual, residual, weight, out, res_out, rstd, a, hp,
        token_slots, ranks if ranks is not None else token_slots, T, N, R, S * R, k_chunk,
        eps, (x if x is not None else residual).stride(0), residual.stride(0), out.stride(0),
        res_out.stride(0), *a.stride(), *hp.stride(),
        HAS_ADD=x is not None, HAS_RANKS=ranks is not None, SPLIT_K=splits,
        BLOCK=triton.next_power_of_2(N), BLOCK_M=BLOCK_M, BLOCK_K=block_k,
        BLOCK_SR=block_sr, PER_ROW=not uniform,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=residual.device.type == "cpu", num_warps=num_warps)
    shrunk = FusedShrunk(hp, rstd, tuple(int(o) for o in slice_offsets), ranks, uniform)
    return out, res_out, shrunk


def expand_fused_shrunk(shrunk: FusedShrunk, b: torch.Tensor, y: torch.Tensor,
                        meta) -> torch.Tensor:
    """y [T, N] += (1/rms · h) · B[slot]ᵀ per slice from a finished `add_rms_norm_shrink`
    (h · B[slot]ᵀ where there is no row scale), in place (after it in stream order);
    meta: the step's `LoRAMeta`. Returns y."""
    offs = shrunk.slice_offsets
    return lora_expand_tokens(shrunk.hp, b, y, meta, _offsets(offs), len(offs) - 1, shrunk.ranks,
                              uniform=shrunk.uniform, row_scale=shrunk.rstd)
