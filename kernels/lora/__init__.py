"""Batched multi-adapter LoRA: the one entry point the engine calls.

CUDA tensors take the Triton kernels on the path kernels/lora/plan.py chooses (launch.py
runs it); other tensors, and CUDA ones where Triton is absent, the torch reference
(reference.py, also the tests' oracle). The choice is made once, at import; nothing here
reads the environment or loops over requests or adapters.

    plan.py         which path a call takes: one table, each entry with its measurement
    meta.py         the step's tokens grouped by slot, built once per step
    launch.py       add_lora on the planned path, and the fused shrinks' halves
    token.py        decode: token-sized grids (programs and launches)
    mixed.py        decode, several adapters: segment tiles (programs: mixed_kernels.py)
    segment.py      prefill: a grouped GEMM over a tile list
    norm_shrink.py  add + RMSNorm + shrink in one launch, and the expand that finishes it
    norm_shrink_cols.py  add + RMSNorm writing its finished shrink as extra columns
    silu_shrink.py  SiLU-and-multiply + shrink in one launch
    slot_rows.py    DoRA's row factors and embed_tokens LoRA
    tiles.py        @triton.jit pieces the programs share
    reference.py    the plain-torch semantics
"""
from __future__ import annotations

import torch

from loramux_kernels.lora.plan import TOKEN_PATH_MAX_TOKENS
from loramux_kernels.lora.reference import (add_embedding_lora_ref, add_lora_ref,
                                    add_rms_norm_shrink_cols_ref, lora_expand_ref,
                                    scale_rows_ref)

try:  # the Triton kernels are optional: absent on machines without Triton
    from loramux_kernels.lora import launch as _launch
    from loramux_kernels.lora import slot_rows as _rows
except ImportError:
    _launch = _rows = None

def _on_triton(t: torch.Tensor) -> bool:
    """Whether calls on `t` take the Triton kernels (CUDA tensors, Triton present).
    Tests on the CPU replace it to run the kernels in Triton's interpreter."""
    return t.is_cuda and _launch is not None


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, slice_offsets: tuple[int, ...],
             ranks: torch.Tensor | None = None, meta=None, uniform: bool = False,
             spread: bool = False) -> torch.Tensor:
    """y[t] += x[t] · A[slot(t)]ᵀ · B[slot(t)]ᵀ per slice, in place, for every token with
    token_slots[t] >= 0; returns y.

    y: [T, N]; x: [T, K]; a: [L, S, R, K]; b: [L, N, R]; token_slots: [T] int;
    ranks: [L] int32 (lets the kernel skip padded rank columns; optional);
    meta: what `build_meta` returned for these token_slots, or None; uniform: a hint that
    the tokens share one adapter; spread: a hint that the tokens with an adapter average
    fewer than `mixed_min_rows` rows per adapter. The hints pick the kernels
    (kernels/lora/plan.py); the result is the same."""
    if _on_triton(y):
        return _launch.add_lora(y, x, a, b, token_slots, slice_offsets, ranks=ranks, meta=meta,
                                uniform=uniform, spread=spread)
    return add_lora_ref(y, x, a, b, token_slots, slice_offsets)


def scale_rows(y: torch.Tensor, scale: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] *= scale[slot(t)] per token, in place (DoRA's per-row factors after the
    LoRA delta is added); scale [L + 1, N], its last row (all ones) read by tokens
    without an adapter (slot -1). Returns y."""
    if _on_triton(y):
        return _rows.scale_rows(y, scale, token_slots)
    return scale_rows_ref(y, scale, token_slots)


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, meta=None) -> torch.Tensor:
    """y [T, H] += B[slot(t)] · A[slot(t)][:, ids[t]] per token with a slot, in place:
    embed_tokens LoRA. a [L, R, V]; b [L, H, R]; meta: `build_meta` of token_slots for
    L slots, or None. Returns y."""
    if _on_triton(y):
        return _rows.add_embedding_lora(y, ids, a, b, token_slots, meta)
    return add_embedding_lora_ref(y, ids, a, b, token_slots)


def mixed_min_rows(device: torch.device, num_tokens: int) -> int:
    """Rows per adapter (rows with an adapter / distinct adapters) a batch of num_tokens
    tokens needs on `device` to go without the `spread` hint; 0 where the hint changes
    nothing (the reference, sizes whose kernels do not depend on it). A host-side number:
    callers count rows and adapters from the slot ids they have, with no device sync."""
    if torch.device(device).type == "cuda" and _launch is not None:
        return _launch.mixed_min_rows(device, num_tokens)
    return 0


def build_meta(token_slots: torch.Tensor, max_loras: int, uniform: bool = False):
    """Per-step metadata for `add_lora` (the tokens grouped by slot), built once per step
    and shared by every layer; None where no kernel reads it (the reference). `uniform`
    is accepted for the callers' symmetry with add_lora; every kernel path reads it."""
    if _on_triton(token_slots):
        return _launch.build_meta(token_slots, max_loras)
    return None


def expand_after(shrunk, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += the LoRA delta from a finished `norm_shrink_ahead` or `silu_shrink_ahead`,
    in place; returns y."""
    return _launch.expand_after(shrunk, b, y)


def expand_rows(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                ranks: torch.Tensor | None = None, meta=None) -> torch.Tensor:
    """y[t] += s[t] · B[slot(t)]ᵀ per token with a slot, in place: the expand of a
    one-slice group whose shrink s was made elsewhere (a base GEMM's extra output
    columns, engine/lora/fused.py). y [T, N] and s [T, R] may be strided views (rows of
    one [T, N + R] GEMM output); b [L, N, R]; ranks [L] int32 or None; meta: the step's
    `build_meta`. Returns y."""
    if _on_triton(y):
        return _launch.expand_rows(y, s, b, token_slots, ranks, meta)
    return lora_expand_ref(s.float()[None], b, token_slots, (0, y.shape[1]), y)


def add_norm_shrink_cols(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                         eps: float, a: torch.Tensor, token_slots: torch.Tensor,
                         ranks: torch.Tensor | None = None, delta=None):
    """([rms_norm(residual + x) | s], residual + x): the norm's output and the finished
    LoRA shrink of it (every slice's R columns, in the rows' dtype, zero on rows without
    an adapter) side by side in one [T, K + S·R] buffer, for a GEMM with [W | B]
    (engine/lora/fused.py); x None: rms_norm(residual), residual. a [L, S, R, K]. delta:
    (d [T, R], bd [L, K, R], ranks of bd or None): x[t] += d[t] · bd[slot(t)]ᵀ first, the
    expand of the group whose output x is (x given). On the Triton path (up to
    TOKEN_PATH_MAX_TOKENS rows) one launch and a new residual tensor."""
    if _on_triton(residual):
        return _launch.add_norm_shrink_cols(x, residual, weight, eps, a, token_slots, ranks,
                                            delta)
    return add_rms_norm_shrink_cols_ref(x, residual, weight, eps, a, token_slots, delta)


def _fused_fits(rows: torch.Tensor, a: torch.Tensor, slice_offsets) -> bool:
    """Whether a shrink may run fused into the op that makes `rows`: a decode batch (1 to
    TOKEN_PATH_MAX_TOKENS rows, contiguous) on the Triton kernels, slices x rank narrow
    enough for one program (kernels/lora/norm_shrink.py fits)."""
    return (rows.is_cuda and _launch is not None and rows.dim() == 2
            and 0 < rows.shape[0] <= TOKEN_PATH_MAX_TOKENS and slice_offsets[-1] != 0
            and rows.stride(-1) == 1 and a.dim() == 4
            and _launch.fused_shrink_fits(a.shape[1], a.shape[2]))


def norm_shrink_ahead(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, a: torch.Tensor, token_slots: torch.Tensor,
                      slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                      meta=None, uniform: bool = False):
    """rms_norm(residual + x) (x None: of residual as it is), the new residual, and the
    shrink half of `add_lora` for those normed rows, in one launch: (out, residual,
    shrunk) for `expand_after`, or None where that does not apply (`_fused_fits`, and x
    of another shape or not contiguous): then the plain norm and `add_lora`.
    The new residual is a new tensor (loramux_kernels.elementwise.add_rms_norm updates it in
    place on CUDA)."""
    if (not _fused_fits(residual, a, slice_offsets)
            or (x is not None and (x.shape != residual.shape or x.stride(-1) != 1))):
        return None
    return _launch.norm_shrink_ahead(x, residual, weight, eps, a, token_slots, slice_offsets,
                                     ranks, meta, uniform)


def silu_shrink_ahead(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                      slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                      meta=None, uniform: bool = False):
    """silu(gate) * up of x = [gate | up] and the shrink half of `add_lora` for it (a
    one-slice group: down_proj) in one launch: (out, shrunk) for `expand_after`, or None
    where that does not apply (`_fused_fits`): then loramux_kernels.elementwise.silu_mul and
    `add_lora`."""
    if not _fused_fits(x, a, slice_offsets):
        return None
    return _launch.silu_shrink_ahead(x, a, token_slots, slice_offsets, ranks, meta, uniform)
