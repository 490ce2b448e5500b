"""The add + RMSNorm whose output carries its LoRA shrink as extra columns: one launch
writes [rms_norm(residual + x) | s] into one [T, K + S·R] buffer, s the finished shrink
of the normed row (scaled by its 1/rms, rounded to the buffer's dtype; zero for rows
without an adapter). A GEMM of that buffer with [W | B] (B block-diagonal over the
slices) is then base output plus LoRA delta in one matmul (engine/lora/fused.py).
Reference: kernels/lora/reference.py add_rms_norm_shrink_cols_ref.

The 1-D grid has two roles, independent of each other:

- programs [0, T): one row each, the add + RMSNorm of kernels/lora/norm_shrink.py
  (`_norm_row`, the same rounding), writing the normed row to the buffer's first K
  columns and the new residual to its own tensor;
- programs [T, T + row blocks · S): (row block, slice), no split-K: the program walks the
  whole row, so it sums the rows' squares itself and finishes s = (w·(x + res))·Aᵀ / rms.
  A block is done one adapter at a time (one pass when the rows share one).

With a delta (HAS_DELTA: the expand of the group before, o or down, whose output x is),
both roles first add x[t] += d[t] · Bd[slot(t)]ᵀ (d [T, R] its shrink, rounded to x's
dtype as its expand would round it): that group then has no launch of its own. The norm
programs then go over the row twice (the sum into the new residual, then the norm of it
read back), the shrink programs add the delta tile by tile.

The shrink programs read x and the old residual while the norm programs run, so the new
residual is never written in place. Grids come from static sizes only (tokens, slices):
capturable in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32
from loramux_kernels.lora.norm_shrink import _norm_row
from loramux_kernels.lora.tiles import block_program, rank_of
from loramux_kernels.lora.token import _block_r


@triton.jit
def _norm_row_delta(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, slots_ptr,
                    d_ptr, db_ptr, dranks_ptr, row, N, R, stride_x, stride_r, stride_o,
                    stride_ro, stride_d, stride_dbl, stride_dbn, stride_dbr, eps,
                    HAS_RANKS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """out = rms_norm(res + (x + d·Bdᵀ)) of one row in BLOCK_N chunks: the sum to
    res_out and its squares first, then the norm of res_out read back; 1/rms to rstd."""
    dt = res_ptr.dtype.element_ty
    slot = tl.load(slots_ptr + row)
    offs_r = tl.arange(0, BLOCK_R)
    rank = tl.where(slot >= 0, rank_of(dranks_ptr, tl.maximum(slot, 0), R, HAS_RANKS), 0)
    r_mask = offs_r < rank           # no delta for a row without an adapter
    d = tl.load(d_ptr + row * stride_d + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    b_base = db_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_dbl
    sumsq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, N, BLOCK_N):
        offs = k0 + tl.arange(0, BLOCK_N)
        mask = offs < N
        bt = tl.load(b_base + offs[:, None] * stride_dbn + offs_r[None, :] * stride_dbr,
                     mask=mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + tl.sum(bt * d[None, :], axis=1)).to(x_ptr.dtype.element_ty)
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        r = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + offs, r, mask=mask)
        sumsq += r.to(tl.float32) * r.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(sumsq, 0) / N + eps)
    tl.store(rstd_ptr + row, rstd)
    tl.debug_barrier()             # the row's sums, stored above, are read back below
    for k0 in range(0, N, BLOCK_N):
        offs = k0 + tl.arange(0, BLOCK_N)
        mask = offs < N
        sf = tl.load(res_out_ptr + row * stride_ro + offs, mask=mask, other=0.0).to(tl.float32)
        h = (sf * rstd).to(out_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0)
        y = w.to(tl.float32) * h.to(tl.float32)
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _delta_tile(d_ptr, db_ptr, dranks_ptr, tok, run, slot, offs_k, k_mask, R, stride_d,
                stride_dbl, stride_dbn, stride_dbr, HAS_RANKS: tl.constexpr,
                BLOCK_R: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """d·Bd[slot]ᵀ of the rows in `run` over columns offs_k, [BLOCK_M, BLOCK_K] float32."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < rank_of(dranks_ptr, slot, R, HAS_RANKS)
    d = tl.load(d_ptr + tok[:, None] * stride_d + offs_r[None, :],
                mask=run[:, None] & r_mask[None, :], other=0.0)
    bt = tl.load(db_ptr + slot.to(tl.int64) * stride_dbl + offs_r[:, None] * stride_dbr
                 + offs_k[None, :] * stride_dbn, mask=r_mask[:, None] & k_mask[None, :],
                 other=0.0)
    return dot_f32(d.to(bt.dtype), bt, PRECISION, UPCAST)


@triton.jit
def _shrink_cols(x_ptr, res_ptr, w_ptr, a_ptr, out_ptr, slots_ptr, ranks_ptr, q, T, K, R, S,
                 eps, stride_x, stride_r, stride_o,
                 stride_al, stride_as, stride_ar, stride_ak,
                 d_ptr, db_ptr, dranks_ptr, stride_d, stride_dbl, stride_dbn, stride_dbr,
                 HAS_ADD: tl.constexpr, HAS_RANKS: tl.constexpr, HAS_DELTA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                 PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Program q = (row block, slice s): s's R columns of the block's rows, finished."""
    _, tok, in_t, left = block_program(slots_ptr, q // S, T, 1, BLOCK_M)
    s = q % S
    offs_r = tl.arange(0, BLOCK_R)
    out = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)   # rows without an adapter: 0
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    slot = tl.max(left, axis=0)
    while slot >= 0:           # one pass per adapter in the block (one when uniform)
        run = left == slot
        rank = rank_of(ranks_ptr, slot, R, HAS_RANKS)
        a_cols = a_ptr + slot.to(tl.int64) * stride_al + s * stride_as + offs_r * stride_ar
        r_mask = offs_r < rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        ss = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            m = run[:, None] & k_mask[None, :]
            v = tl.load(res_ptr + tok[:, None] * stride_r + offs_k[None, :], mask=m, other=0.0)
            if HAS_ADD:   # the sum rounded to the residual's dtype, as the norm rounds it
                xv = tl.load(x_ptr + tok[:, None] * stride_x + offs_k[None, :], mask=m,
                             other=0.0)
                if HAS_DELTA:   # x + the group before's delta, rounded as its expand would
                    xv = (xv.to(tl.float32) + _delta_tile(
                        d_ptr, db_ptr, dranks_ptr, tok, run, slot, offs_k, k_mask, R,
                        stride_d, stride_dbl, stride_dbn, stride_dbr, HAS_RANKS, BLOCK_R,
                        PRECISION, UPCAST)).to(x_ptr.dtype.element_ty)
                v = (xv.to(tl.float32) + v.to(tl.float32)).to(res_ptr.dtype.element_ty)
            vf = v.to(tl.float32)
            ss += tl.sum(vf * vf, axis=1)
            w = tl.load(w_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
            u = w[None, :] * vf
            at = tl.load(a_cols[None, :] + offs_k[:, None] * stride_ak,
                         mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            acc += dot_f32(u.to(at.dtype), at, PRECISION, UPCAST)
        out = tl.where(run[:, None], acc, out)
        sumsq = tl.where(run, ss, sumsq)
        left = tl.where(run, -1, left)
        slot = tl.max(left, axis=0)
    rstd = 1.0 / tl.sqrt(sumsq / K + eps)
    out = out * rstd[:, None]
    ptrs = out_ptr + tok[:, None] * stride_o + K + s * R + offs_r[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=in_t[:, None] & (offs_r < R)[None, :])


# T (the step's tokens) only bounds rows: no variant per value class
@triton.jit(do_not_specialize=["T"])
def add_rms_norm_shrink_cols_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr,
                                    a_ptr, slots_ptr, ranks_ptr, d_ptr, db_ptr, dranks_ptr,
                                    T, K, R, S, eps,
                                    stride_x, stride_r, stride_o, stride_ro,
                                    stride_al, stride_as, stride_ar, stride_ak,
                                    stride_d, stride_dbl, stride_dbn, stride_dbr,
                                    HAS_ADD: tl.constexpr, HAS_RANKS: tl.constexpr,
                                    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                                    BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Grid (T + cdiv(T, BLOCK_M) * S,): program p < T normalises row p into out[p, :K];
    the others write out[rows, K + s·R : K + (s+1)·R] (module docstring). HAS_ADD False:
    no x, the residual is normed as it is and res_out is not written; HAS_DELTA (with
    HAS_ADD): x[t] + d[t]·Bd[slot(t)]ᵀ in place of x."""
    pid = tl.program_id(0)
    if pid < T:
        if HAS_DELTA:
            _norm_row_delta(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, slots_ptr,
                            d_ptr, db_ptr, dranks_ptr, pid.to(tl.int64), K, R, stride_x,
                            stride_r, stride_o, stride_ro, stride_d, stride_dbl, stride_dbn,
                            stride_dbr, eps, HAS_RANKS, BLOCK_N, BLOCK_R)
        else:
            _norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, rstd_ptr, pid.to(tl.int64),
                      K, stride_x, stride_r, stride_o, stride_ro, eps, HAS_ADD, BLOCK)
    else:
        _shrink_cols(x_ptr, res_ptr, w_ptr, a_ptr, out_ptr, slots_ptr, ranks_ptr, pid - T, T,
                     K, R, S, eps, stride_x, stride_r, stride_o,
                     stride_al, stride_as, stride_ar, stride_ak,
                     d_ptr, db_ptr, dranks_ptr, stride_d, stride_dbl, stride_dbn, stride_dbr,
                     HAS_ADD, HAS_RANKS, HAS_DELTA, BLOCK_M, BLOCK_K, BLOCK_R, PRECISION,
                     UPCAST)


MAX_TOKENS = 256           # the decode path (kernels/lora/plan.py TOKEN_PATH_MAX_TOKENS)
BLOCK_M = 16               # rows per shrink program (tl.dot needs 16)
ROW_ALIGN = 64             # the output's row stride, in elements: 128-byte rows in bf16,
                           # an aligned leading dimension for the GEMM that reads it


def add_rms_norm_shrink_cols(x: torch.Tensor | None, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float, a: torch.Tensor,
                             token_slots: torch.Tensor, ranks: torch.Tensor | None = None,
                             delta=None, block_k: int | None = None, num_warps: int = 4
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [T, K + S·R] = [rms_norm(residual + x) | s], residual + x) in one launch
    (out's rows padded to a multiple of ROW_ALIGN elements: a view).

    s[t, s·R + r] = rms_norm(residual + x)[t] · A[slot(t), s, r]ᵀ, in out's dtype, zero
    where token_slots[t] < 0. x None: rms_norm(residual) and residual itself. The new
    residual is a new tensor. x, residual [T, K] (rows contiguous); weight [K];
    a [L, S, R, K]; token_slots [T]; ranks [L] int32 or None (then R). delta: None, or
    (d [T, R], bd [L, K, R], dranks [L] int32 or None as ranks is): x[t] += d[t] ·
    bd[slot(t)]ᵀ first (rounded to x's dtype), with x given. block_k, num_warps: launch
    parameters."""
    T, K = residual.shape
    L, S, R, Ka = a.shape
    assert 0 < T <= MAX_TOKENS and Ka == K, (T, Ka, K)
    assert residual.stride(-1) == 1 and weight.shape == (K,) and weight.stride(0) == 1
    assert x is None or (x.shape == residual.shape and x.stride(-1) == 1)
    assert token_slots.shape == (T,)
    block_r = _block_r(R)
    block_k = block_k or max(32, min(2048 // BLOCK_M, 4096 // block_r,
                                     triton.next_power_of_2(K)))
    width = K + S * R
    out = torch.empty((T, -(-width // ROW_ALIGN) * ROW_ALIGN), dtype=residual.dtype,
                      device=residual.device)[:, :width]
    res_out = torch.empty_like(residual) if x is not None else residual
    rstd = torch.empty(T, dtype=torch.float32, device=residual.device)  # the norm rows'
    src = x if x is not None else residual
    d, bd, dranks = delta if delta is not None else (src, a, ranks)
    assert delta is None or (x is not None and d.shape == (T, R) and d.stride(1) == 1
                             and bd.shape == (L, K, R) and (dranks is None) == (ranks is None))
    grid = (T + triton.cdiv(T, BLOCK_M) * S,)
    add_rms_norm_shrink_cols_kernel[grid](
        src, residual, weight, out, res_out, rstd, a, token_slots,
        ranks if ranks is not None else token_slots, d, bd,
        dranks if dranks is not None else token_slots, T, K, R, S, eps,
        src.stride(0), residual.stride(0), out.stride(0), res_out.stride(0), *a.stride(),
        d.stride(0), *(bd.stride() if delta is not None else (0, 0, 0)),
        HAS_ADD=x is not None, HAS_RANKS=ranks is not None, HAS_DELTA=delta is not None,
        BLOCK=triton.next_power_of_2(K),
        BLOCK_N=max(16, min(256, 4096 // block_r, triton.next_power_of_2(K))),
        BLOCK_M=BLOCK_M, BLOCK_K=block_k, BLOCK_R=block_r,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=residual.device.type == "cpu", num_warps=num_warps)
    return out, res_out
