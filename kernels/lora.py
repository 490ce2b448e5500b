"""Dispatch for batched multi-adapter LoRA: the Triton kernels on CUDA, the torch
reference elsewhere (and on CUDA when the Triton module is not available).

The choice is made once, at import; nothing here reads the environment or loops over
requests or adapters. Layout and semantics: kernels/lora_ref.py.
"""
from __future__ import annotations

import torch

from kernels.lora_ref import add_embedding_lora_ref, add_lora_ref, scale_rows_ref

try:  # the Triton module is optional: absent on machines without Triton
    from kernels import lora_triton as _triton
    from kernels import slot_rows_triton as _rows_triton
except ImportError:
    _triton = _rows_triton = None


def _on_triton(t: torch.Tensor) -> bool:
    """Whether calls on `t` take the Triton kernels (CUDA tensors, Triton present).
    Tests on the CPU replace it to run the kernels in Triton's interpreter."""
    return t.is_cuda and _triton is not None


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, slice_offsets: tuple[int, ...],
             ranks: torch.Tensor | None = None, meta=None, uniform: bool = False,
             spread: bool = False) -> torch.Tensor:
    """y[t] += x[t] · A[slot(t)]ᵀ · B[slot(t)]ᵀ per slice, in place, for every token with
    token_slots[t] >= 0; returns y.

    y: [T, N]; x: [T, K]; a: [L, S, R, K]; b: [L, N, R]; token_slots: [T] int;
    ranks: [L] int32 (lets the kernel skip padded rank columns; optional);
    meta: what `build_meta` returned for these token_slots, or None; uniform: a hint that
    the tokens share one adapter (launch parameters only; the result is the same);
    spread: a hint that the tokens with an adapter average fewer than `mixed_min_rows` rows
    per adapter (which kernels run; the result is the same)."""
    if _on_triton(y):
        return _triton.add_lora(y, x, a, b, token_slots, slice_offsets, ranks=ranks, meta=meta,
                                uniform=uniform, spread=spread)
    return add_lora_ref(y, x, a, b, token_slots, slice_offsets)


def scale_rows(y: torch.Tensor, scale: torch.Tensor, token_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] *= scale[slot(t)] per token, in place (DoRA's per-row factors after the
    LoRA delta is added); scale [L + 1, N], its last row (all ones) read by tokens
    without an adapter (slot -1). Returns y."""
    if _on_triton(y):
        return _rows_triton.scale_rows(y, scale, token_slots)
    return scale_rows_ref(y, scale, token_slots)


def add_embedding_lora(y: torch.Tensor, ids: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       token_slots: torch.Tensor, meta=None) -> torch.Tensor:
    """y [T, H] += B[slot(t)] · A[slot(t)][:, ids[t]] per token with a slot, in place:
    embed_tokens LoRA. a [L, R, V]; b [L, H, R]; meta: `build_meta` of token_slots for
    L slots, or None. Returns y."""
    if _on_triton(y):
        return _rows_triton.add_embedding_lora(y, ids, a, b, token_slots, meta)
    return add_embedding_lora_ref(y, ids, a, b, token_slots)


def mixed_min_rows(device: torch.device, num_tokens: int) -> int:
    """Rows per adapter (rows with an adapter / distinct adapters) a batch of num_tokens
    tokens needs on `device` to go without the `spread` hint; 0 where the hint changes
    nothing (the reference, sizes whose kernels do not depend on it). A host-side number:
    callers count rows and adapters from the slot ids they have, with no device sync."""
    if torch.device(device).type == "cuda" and _triton is not None:
        return _triton.mixed_min_rows(device, num_tokens)
    return 0


def build_meta(token_slots: torch.Tensor, max_loras: int, uniform: bool = False):
    """Per-step metadata for `add_lora` (e.g. tokens grouped by slot), built once per step
    and shared by every layer; None where the chosen path needs none (the reference, and
    the one-launch path of a `uniform` step, which reads token_slots as they are)."""
    if (_on_triton(token_slots)
            and _triton.uses_meta(token_slots.shape[0], uniform)):
        return _triton.build_meta(token_slots, max_loras)
    return None


def shrink_ahead(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                 slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                 meta=None, uniform: bool = False):
    """The shrink half of `add_lora` for a `uniform` decode call, launched on its own (it
    reads only x: it may run on another stream beside the base matmul), for
    `expand_after`; None where that split does not apply (CPU, no Triton, more than 256
    tokens, not `uniform`): then use `add_lora` as usual."""
    if (not uniform or not x.is_cuda or _triton is None or x.shape[0] == 0
            or x.shape[0] > _triton.TOKEN_PATH_MAX_TOKENS or slice_offsets[-1] == 0):
        return None
    return _triton.shrink_ahead(x, a, token_slots, slice_offsets, ranks, meta)


def expand_after(shrunk, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += the LoRA delta from a finished `shrink_ahead`, `norm_shrink_ahead` or
    `silu_shrink_ahead`, in place; returns y."""
    return _triton.expand_after(shrunk, b, y)


def norm_shrink_ahead(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float, a: torch.Tensor, token_slots: torch.Tensor,
                      slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                      meta=None, uniform: bool = False):
    """rms_norm(residual + x) (x None: of residual as it is), the new residual, and the
    shrink half of `add_lora` for those normed rows, in one launch: (out, residual,
    shrunk) for `expand_after`, or None where that does not apply (CPU, no Triton, no
    tokens or more than 256, rows not contiguous, slices x rank too wide for one program:
    kernels/norm_shrink_triton.py fits): then the plain norm and `add_lora`.
    The new residual is a new tensor (kernels.elementwise.add_rms_norm updates it in
    place on CUDA)."""
    if (not residual.is_cuda or _triton is None or residual.dim() != 2
            or not 0 < residual.shape[0] <= _triton.TOKEN_PATH_MAX_TOKENS
            or slice_offsets[-1] == 0 or residual.stride(-1) != 1
            or (x is not None and (x.shape != residual.shape or x.stride(-1) != 1))
            or a.dim() != 4 or not _triton.fused_shrink_fits(a.shape[1], a.shape[2])):
        return None
    return _triton.norm_shrink_ahead(x, residual, weight, eps, a, token_slots, slice_offsets,
                                     ranks, meta, uniform)


def silu_shrink_ahead(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                      slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                      meta=None, uniform: bool = False):
    """silu(gate) * up of x = [gate | up] and the shrink half of `add_lora` for it (a
    one-slice group: down_proj) in one launch: (out, shrunk) for `expand_after`, or None
    where that does not apply (CPU, no Triton, no tokens or more than 256, rows not
    contiguous, a rank too wide for one program): then kernels.elementwise.silu_mul and
    `add_lora`."""
    if (not x.is_cuda or _triton is None or x.dim() != 2
            or not 0 < x.shape[0] <= _triton.TOKEN_PATH_MAX_TOKENS
            or slice_offsets[-1] == 0 or x.stride(-1) != 1
            or a.dim() != 4 or not _triton.fused_shrink_fits(a.shape[1], a.shape[2])):
        return None
    return _triton.silu_shrink_ahead(x, a, token_slots, slice_offsets, ranks, meta, uniform)
