"""Host wrappers of kernels/slot_rows_kernels_triton.py (CUDA, or the interpreter): the
per-token, slot-indexed parts of DoRA and of LoRA on the model's ends (lm_head,
embed_tokens). References: kernels/lora_ref.py."""
from __future__ import annotations

import torch
import triton

from kernels import slot_rows_kernels_triton as K
from kernels import lora_triton
from kernels.lora_token_triton import _offsets, lora_expand_tokens


def scale_rows(y: torch.Tensor, scale: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] *= scale[slot(t)] per token, in place; scale [L + 1, N], whose last row a
    token without an adapter (slot -1) reads. Returns y."""
    T, N = y.shape
    assert scale.dim() == 2 and scale.shape[1] == N and token_slots.shape == (T,), (
        tuple(y.shape), tuple(scale.shape), tuple(token_slots.shape))
    if T and N:
        block = min(1024, triton.next_power_of_2(N))
        K.scale_rows_kernel[(T, triton.cdiv(N, block))](
            y, scale, token_slots, N, scale.shape[0] - 1, y.stride(0), y.stride(1),
            scale.stride(0), scale.stride(1), BLOCK_N=block)
    return y


def gather_a_columns(ids: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h [T, R] float32: column ids[t] of a[slot(t)] ([L, R, V]), zero without a slot."""
    T, (L, R, V) = ids.shape[0], a.shape
    h = torch.empty((T, R), dtype=torch.float32, device=a.device)
    if T:
        K.gather_a_columns_kernel[(T,)](ids, token_slots, a, h, R, *a.stride(), *h.stride(),
                                        BLOCK_R=triton.next_power_of_2(R))
    return h


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, meta=None) -> torch.Tensor:
    """y [T, H] += B[slot(t)] · A[slot(t)][:, ids[t]] per token, in place: the gathered
    columns are the shrink, the LoRA expand kernels (grouped by slot) add B. a [L, R, V],
    b [L, H, R]; meta: lora_triton.build_meta of token_slots for L slots, or None."""
    T, H = y.shape
    L, R, _ = a.shape
    assert b.shape == (L, H, R) and ids.shape == (T,) == token_slots.shape, (
        tuple(a.shape), tuple(b.shape), tuple(y.shape))
    if T == 0:
        return y
    if meta is None:
        meta = lora_triton.build_meta(token_slots, L)
    h = gather_a_columns(ids, a, token_slots)
    if T <= lora_triton.TOKEN_PATH_MAX_TOKENS:
        return lora_expand_tokens(h[None, None], b, y, meta, _offsets((0, H)), 1)  # one slice
    return lora_triton.lora_expand(h[None], b, y, meta, (0, H))
