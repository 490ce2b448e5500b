"""The per-token, slot-indexed parts of DoRA and of LoRA on the model's ends (lm_head,
embed_tokens): programs and launches (CUDA, or the interpreter). References:
kernels/lora/reference.py."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from loramux_kernels.lora.meta import build_meta
from loramux_kernels.lora.plan import TOKEN_PATH_MAX_TOKENS
from loramux_kernels.lora.segment import seg_expand
from loramux_kernels.lora.token import _offsets, lora_expand_tokens


# ---- the programs ----------------------------------------------------------------------
# Triton programs that read one row of a slot-indexed table per token (launches:
# below): DoRA's per-row output factors and the embedding LoRA's column of A. Each token's slot comes from the step's token_slots, so the grids depend
# only on the token count and widths, never on which adapters are in the batch.


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


# ---- their launches --------------------------------------------------------------------

def scale_rows(y: torch.Tensor, scale: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] *= scale[slot(t)] per token, in place; scale [L + 1, N], whose last row a
    token without an adapter (slot -1) reads. Returns y."""
    T, N = y.shape
    assert scale.dim() == 2 and scale.shape[1] == N and token_slots.shape == (T,), (
        tuple(y.shape), tuple(scale.shape), tuple(token_slots.shape))
    if T and N:
        block = min(1024, triton.next_power_of_2(N))
        scale_rows_kernel[(T, triton.cdiv(N, block))](
            y, scale, token_slots, N, scale.shape[0] - 1, y.stride(0), y.stride(1),
            scale.stride(0), scale.stride(1), BLOCK_N=block)
    return y


def gather_a_columns(ids: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, R] float32: column ids[t] of a[slot(t)] ([L, R, V]), zero without a slot."""
    T, (L, R, V) = ids.shape[0], a.shape
    h = torch.empty((T, R), dtype=torch.float32, device=a.device)
    if T:
        gather_a_columns_kernel[(T,)](ids, token_slots, a, h, R, *a.stride(), *h.stride(),
                                        BLOCK_R=triton.next_power_of_2(R))
    return h


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, meta=None) -> torch.Tensor:
    """y [T, H] += B[slot(t)] · A[slot(t)][:, ids[t]] per token, in place: the gathered
    columns are the shrink, the LoRA expand kernels (grouped by slot) add B. a [L, R, V],
    b [L, H, R]; meta: loramux_kernels.lora.meta.build_meta of token_slots for L slots, or None."""
    T, H = y.shape
    L, R, _ = a.shape
    assert b.shape == (L, H, R) and ids.shape == (T,) == token_slots.shape, (
        tuple(a.shape), tuple(b.shape), tuple(y.shape))
    if T == 0:
        return y
    if meta is None:
        meta = build_meta(token_slots, L)
    h = gather_a_columns(ids, a, token_slots)
    if T <= TOKEN_PATH_MAX_TOKENS:
        return lora_expand_tokens(h[None, None], b, y, meta, _offsets((0, H)), 1)  # one slice
    return seg_expand(h[None, None], b, y, meta, (0, H))   # the prefill path's expand
