"""Plain-torch reference for batched multi-adapter LoRA (shrink x·A, expand ·B).

Weights live in a fixed slot pool, one pool tensor per LoRA-wrapped layer:

    a: [L, S, R, K]   L slots, S slices (3 for q/k/v, 2 for gate/up, else 1),
                      R = max_lora_rank, K = input width (this rank's shard)
    b: [L, N, R]      N = sum of slice output widths; slice s owns rows
                      slice_offsets[s]:slice_offsets[s+1]; scaling already folded in
    ranks: [L] int32  real rank of each slot; rows/cols past it are zero in a and b

`token_slots[t]` is the slot of token t, or -1 for "no adapter" (adds nothing).
The reference gathers per-token weights and uses batched matmuls: no loop over
requests or adapters.
"""
from __future__ import annotations

import torch

from loramux_kernels.elementwise_ref import rms_norm_ref, silu_mul_ref


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """h[s, t, :] = x[t] @ a[slot(t), s].T, float32; zero where token_slots[t] < 0.

    x: [T, K]; a: [L, S, R, K]; returns [S, T, R] float32."""
    valid = token_slots >= 0
    idx = token_slots.clamp(min=0).long()
    a_tok = a.index_select(0, idx).float()            # [T, S, R, K]
    h = torch.einsum("tk,tsrk->str", x.float(), a_tok)
    return h * valid.view(1, -1, 1).float()


def lora_expand_ref(h: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                    slice_offsets: tuple[int, ...], y: torch.Tensor) -> torch.Tensor:
    """y[t, off_s:off_s+1] += h[s, t] @ b[slot(t), off_s:off_s+1].T for every slice s,
    in place, for tokens with a slot. h: [S, T, R]; b: [L, N, R]; y: [T, N]."""
    valid = token_slots >= 0
    idx = token_slots.clamp(min=0).long()
    b_tok = b.index_select(0, idx).float()            # [T, N, R]
    for s in range(len(slice_offsets) - 1):           # slices are static (<= 3), not data
        lo, hi = slice_offsets[s], slice_offsets[s + 1]
        delta = torch.einsum("tr,tnr->tn", h[s], b_tok[:, lo:hi])
        delta = delta * valid.view(-1, 1).float()
        y[:, lo:hi] += delta.to(y.dtype)
    return y


def add_lora_ref(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                 token_slots: torch.Tensor, slice_offsets: tuple[int, ...]) -> torch.Tensor:
    """y += LoRA(x) for a mixed-adapter batch; returns y."""
    h = lora_shrink_ref(x, a, token_slots)
    return lora_expand_ref(h, b, token_slots, slice_offsets, y)


def add_rms_norm_shrink_ref(x: torch.Tensor | None, residual: torch.Tensor,
                            weight: torch.Tensor, eps: float, a: torch.Tensor,
                            token_slots: torch.Tensor):
    """(rms_norm(residual + x), residual + x, h [S, T, R] float32: the LoRA shrink of the
    normed rows, zero where token_slots[t] < 0); x None: nothing added to residual. The
    oracle of kernels/lora/norm_shrink.py."""
    if x is not None:
        residual = residual + x
    out = rms_norm_ref(residual, weight, eps)
    return out, residual, lora_shrink_ref(out, a, token_slots)


def add_rms_norm_shrink_cols_ref(x: torch.Tensor | None, residual: torch.Tensor,
                                 weight: torch.Tensor, eps: float, a: torch.Tensor,
                                 token_slots: torch.Tensor, delta=None):
    """([rms_norm(residual + x) | s] [T, K + S·R], residual + x): s the LoRA shrink of
    the normed rows, slice after slice, in the rows' dtype, zero where token_slots[t] < 0;
    x None: nothing added to residual. delta (d [T, R], bd [L, K, R], ranks): x + the
    expand of d first, as lora_expand_ref adds it. The oracle of
    kernels/lora/norm_shrink_cols.py."""
    if delta is not None:
        x = lora_expand_ref(delta[0].float()[None], delta[1], token_slots, (0, x.shape[1]),
                            x.clone())
    out, residual, h = add_rms_norm_shrink_ref(x, residual, weight, eps, a, token_slots)
    s = h.permute(1, 0, 2).reshape(out.shape[0], -1)        # [T, S·R], slice by slice
    return torch.cat([out, s.to(out.dtype)], dim=1), residual


def silu_mul_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor):
    """(silu(gate) * up of x = [gate | up], h [1, T, R] float32: the LoRA shrink of it,
    zero where token_slots[t] < 0). The oracle of kernels/lora/silu_shrink.py."""
    out = silu_mul_ref(x)
    return out, lora_shrink_ref(out, a, token_slots)


def scale_rows_ref(y: torch.Tensor, scale: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] *= scale[slot(t)] in place (product in the wider dtype, rounded once to
    y's); scale [L + 1, N], its last row read by tokens without an adapter (slot -1).
    DoRA's per-row factors (engine/lora/dora.py). Returns y."""
    idx = torch.where(token_slots < 0, scale.shape[0] - 1, token_slots).long()
    return y.mul_(scale.index_select(0, idx))


def add_embedding_lora_ref(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor,
                           b: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, H] += B[slot(t)] · A[slot(t)][:, ids[t]] in place for tokens with a slot:
    embed_tokens LoRA (PEFT's lora_embedding_A [R, V] and _B [H, R] per slot; a
    [L, R, V], b [L, H, R]). The shrink of a one-hot input is a column of A."""
    valid = token_slots >= 0
    idx = token_slots.clamp(min=0).long()
    h = a[idx, :, ids.long()].float() * valid.view(-1, 1).float()      # [T, R]
    return lora_expand_ref(h[None], b, token_slots, (0, b.shape[1]), y)
