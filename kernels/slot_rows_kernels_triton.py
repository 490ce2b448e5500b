"""Triton programs that read one row of a slot-indexed table per token (host wrappers:
kernels/slot_rows_triton.py): DoRA's per-row output factors and the embedding LoRA's
column of A. Each token's slot comes from the step's token_slots, so the grids depend
only on the token count and widths, never on which adapters are in the batch."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def scale_rows_kernel(y_ptr, scale_ptr, slots_ptr, N, base_row, stride_yt, stride_yn,
                      stride_st, stride_sn, BLOCK_N: tl.constexpr):
    """Grid (T, N blocks): y[t, n] *= scale[slot(t), n] in float32, rounded once to y's
    dtype; a token without an adapter (slot -1) reads row `base_row` (all ones)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    slot = tl.load(slots_ptr + t).to(tl.int64)
    slot = tl.where(slot < 0, base_row, slot)
    s = tl.load(scale_ptr + slot * stride_st + offs * stride_sn, mask=mask, other=1.0)
    y_ptrs = y_ptr + t * stride_yt + offs * stride_yn
    y = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y.to(tl.float32) * s.to(tl.float32)).to(y.dtype), mask=mask)


@triton.jit
def gather_a_columns_kernel(ids_ptr, slots_ptr, a_ptr, h_ptr, R, stride_al, stride_ar,
                            stride_ak, stride_ht, stride_hr, BLOCK_R: tl.constexpr):
    """Grid (T,): h[t, :] = a[slot(t), :, id(t)] in float32 (the shrink of a one-hot
    input), zero for a token without an adapter."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    tok = tl.load(ids_ptr + t).to(tl.int64)
    mask = offs < tl.where(slot >= 0, R, 0)   # nothing to read without a slot
    col = tl.load(a_ptr + tl.maximum(slot, 0) * stride_al + offs * stride_ar
                  + tok * stride_ak, mask=mask, other=0.0)
    tl.store(h_ptr + t * stride_ht + offs * stride_hr, col.to(tl.float32), mask=offs < R)
