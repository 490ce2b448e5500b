"""Batched multi-adapter LoRA on the GPU: y += x·A_slot·B_slot for a mixed-adapter batch,
on the path kernels/lora/plan.py chooses. Same semantics as kernels/lora/reference.py.

Each call takes the step's `LoRAMeta` (kernels/lora/meta.py), built once per step and
shared by every layer. Nothing here syncs with the host: grids come from static sizes
(token count, slot count) and surplus programs return at once, so the launches can be
captured in CUDA graphs with static metadata buffers.
"""
from __future__ import annotations

import torch

from loramux_kernels.lora import mixed, plan
from loramux_kernels.lora.meta import MAX_SLICES, LoRAMeta, build_meta, check_call
from loramux_kernels.lora.norm_shrink import add_rms_norm_shrink, expand_fused_shrunk
from loramux_kernels.lora.norm_shrink import fits as fused_shrink_fits
from loramux_kernels.lora.norm_shrink_cols import add_rms_norm_shrink_cols
from loramux_kernels.lora.segment import add_lora_seg
from loramux_kernels.lora.silu_shrink import silu_mul_shrink
from loramux_kernels.lora.token import _offsets, lora_expand_tokens, lora_shrink_tokens

__all__ = ["LoRAMeta", "add_lora", "add_lora_on", "build_meta", "expand_after", "expand_rows",
           "fused_shrink_fits", "add_norm_shrink_cols",
           "mixed_min_rows", "norm_shrink_ahead", "silu_shrink_ahead"]


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             token_slots: torch.Tensor, slice_offsets: tuple[int, ...],
             ranks: torch.Tensor | None = None, meta: LoRAMeta | None = None,
             uniform: bool = False, spread: bool = False) -> torch.Tensor:
    """y [T, N] += LoRA(x) per token's slot (-1: nothing), in place; returns y.

    x [T, K]; a [L, S, R, K]; b [L, N, R] (scaling folded in); slice_offsets: S+1 ints;
    ranks [L] int32 real rank per slot (work stops there); meta: from `build_meta`, built
    here when absent (pass it in: it is shared by every layer of a step); uniform: a hint
    that the tokens share one adapter; spread: a hint that the rows average fewer than
    `mixed_min_rows` rows per adapter. The hints and the slots' rank (a's R) pick the path
    (plan.choose) and its launch parameters; any mapping stays correct on any path."""
    slice_offsets = tuple(int(o) for o in slice_offsets)
    check_call(y, x, a, b, token_slots, slice_offsets, meta)
    T, Kdim = x.shape
    if T == 0 or slice_offsets[-1] == 0:
        return y
    if meta is None:
        meta = build_meta(token_slots, a.shape[0])
    widest = max(hi - lo for lo, hi in zip(slice_offsets, slice_offsets[1:]))
    path = plan.choose(x.device, T, uniform, spread, a.shape[1], Kdim, widest, a.shape[2])
    return add_lora_on(path, y, x, a, b, meta, slice_offsets, ranks, uniform)


def add_lora_on(path: str, y: torch.Tensor, x: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, meta: LoRAMeta, slice_offsets: tuple[int, ...],
                ranks: torch.Tensor | None = None, uniform: bool = False) -> torch.Tensor:
    """`add_lora` on the form `path` names (plan.TOKENS, MIXED or TILES; TOKENS and MIXED
    up to plan.TOKEN_PATH_MAX_TOKENS rows), whatever the planner would choose: the
    planner's table is measured by timing each (benchmarks/plan_grid.py)."""
    if path == plan.TILES:
        return add_lora_seg(y, x, a, b, meta, slice_offsets, ranks)
    if path == plan.MIXED:
        return mixed.add_lora_mixed(y, x, a, b, meta, slice_offsets, ranks)
    assert path == plan.TOKENS, path
    hp = lora_shrink_tokens(x, a, meta, ranks, uniform=uniform)
    return lora_expand_tokens(hp, b, y, meta, _offsets(slice_offsets), len(slice_offsets) - 1,
                              ranks, uniform=uniform)


def mixed_min_rows(device: torch.device, num_tokens: int) -> int:
    """Rows per adapter a mixed batch of num_tokens tokens needs on `device` for the
    planner's MIXED entries (fewer: hint `spread` to add_lora, which then keeps the token
    kernels); 0 where the hint changes no launch."""
    return plan.min_rows(plan.device_facts(torch.device(device))[0], num_tokens)


def _check_fused(T: int, Kdim: int, a: torch.Tensor, token_slots: torch.Tensor,
                 offsets: tuple[int, ...], meta: LoRAMeta | None) -> None:
    L, S, R, Ka = a.shape
    if Ka != Kdim or len(offsets) != S + 1 or S > MAX_SLICES:
        raise ValueError(f"a [L, S, R, K] {tuple(a.shape)} does not fit rows of width {Kdim} "
                         f"and slice_offsets={offsets} (at most {MAX_SLICES} slices)")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is not None and (meta.num_tokens != T or meta.num_slots != L):
        raise ValueError(f"meta was built for T={meta.num_tokens}, L={meta.num_slots}; "
                         f"this call has T={T}, L={L}")


def norm_shrink_ahead(x, residual, weight, eps, a, token_slots, slice_offsets,
                      ranks: torch.Tensor | None, meta: LoRAMeta | None, uniform: bool):
    """Add + RMSNorm and the shrink of its output in one launch
    (kernels/lora/norm_shrink.py): (out, new residual, shrunk for `expand_after`)."""
    offsets = tuple(int(o) for o in slice_offsets)
    T, Kdim = residual.shape
    _check_fused(T, Kdim, a, token_slots, offsets, meta)
    if meta is None:
        meta = build_meta(token_slots, a.shape[0])
    out, residual, shrunk = add_rms_norm_shrink(x, residual, weight, eps, a, token_slots,
                                                offsets, ranks, uniform)
    return out, residual, (shrunk, meta)


def silu_shrink_ahead(x, a, token_slots, slice_offsets, ranks: torch.Tensor | None,
                      meta: LoRAMeta | None, uniform: bool):
    """SiLU-and-multiply and the shrink of its output in one launch
    (kernels/lora/silu_shrink.py): (out, shrunk for `expand_after`)."""
    offsets = tuple(int(o) for o in slice_offsets)
    T, two_i = x.shape
    L, S, R, Ka = a.shape
    if S != 1 or two_i != 2 * Ka or len(offsets) != 2:
        raise ValueError(f"a [L, S, R, K] {tuple(a.shape)} and slice_offsets={offsets}: need "
                         f"one slice of K={two_i // 2} (x is [gate | up] of width {two_i})")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is None:
        meta = build_meta(token_slots, L)
    out, shrunk = silu_mul_shrink(x, a, token_slots, offsets, ranks, uniform)
    return out, (shrunk, meta)


def expand_after(shrunk, b: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """y += the delta of a finished `norm_shrink_ahead` or `silu_shrink_ahead` (after it
    in stream order), in place."""
    fused, meta = shrunk
    return expand_fused_shrunk(fused, b, y, meta)


def expand_rows(y: torch.Tensor, s: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                ranks: torch.Tensor | None, meta: LoRAMeta | None) -> torch.Tensor:
    """y [T, N] += s[t] · B[slot(t)]ᵀ, in place, with the token-sized expand (one slice,
    s as its only split-K partial: the kernel reads it through its strides, whatever its
    dtype); `loramux_kernels.lora.expand_rows`."""
    T, N = y.shape
    L, Nb, R = b.shape
    if s.shape != (T, R) or Nb != N or token_slots.shape != (T,):
        raise ValueError(f"expand_rows: y {tuple(y.shape)}, s {tuple(s.shape)}, b "
                         f"{tuple(b.shape)}, token_slots {tuple(token_slots.shape)} do not fit")
    if meta is None:
        meta = build_meta(token_slots, L)
    return lora_expand_tokens(s[None, None], b, y, meta, _offsets((0, N)), 1, ranks,
                              uniform=True)


def add_norm_shrink_cols(x, residual, weight, eps, a, token_slots, ranks: torch.Tensor | None,
                         delta=None):
    """Add + RMSNorm writing its finished shrink as extra columns, one launch
    (kernels/lora/norm_shrink_cols.py): ([out | s], new residual)."""
    T, Kdim = residual.shape
    _check_fused(T, Kdim, a, token_slots, (0,) * (a.shape[1] + 1), None)
    return add_rms_norm_shrink_cols(x, residual, weight, eps, a, token_slots, ranks, delta)
