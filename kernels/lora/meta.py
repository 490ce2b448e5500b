"""The per-step layout of a LoRA batch: the step's token->slot mapping grouped by slot
once (`build_meta`), then read by every layer's launches:

    token_slots    [ 2  0 -1  2  0 ]          (T = 5, L = 4 slots)
    sorted_tokens  [ 1  4  0  3  2 ]          stable sort by slot, no-adapter tokens last
    active_slots   [ 0  2 -1 -1 ]             slots with tokens first, padded with -1
    seg_start      [ 0  2  4  4 ]             where each active slot's run starts ...
    seg_len        [ 2  2  0  0 ]             ... and how long it is

Device ops only, no host sync: the buffers can be captured in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loramux_kernels.lora.plan import TOKEN_PATH_MAX_TOKENS

MAX_SLICES = 4             # the programs take five slice bounds


@dataclass(frozen=True)
class LoRAMeta:
    """Per-step LoRA batch layout, built once by `build_meta` and shared by all layers."""
    sorted_tokens: torch.Tensor  # [T] int32 token indices grouped by slot, -1 tokens last
    active_slots: torch.Tensor   # [L] int32 slots that have tokens, then -1
    seg_start: torch.Tensor      # [L] int32 start of each active slot's run in sorted_tokens
    seg_len: torch.Tensor        # [L] int32 length of that run (0 past the active ones)
    sorted_slots: torch.Tensor   # [T] int32 slot of each sorted token (-1 last)
    counters: torch.Tensor       # [4 * min(T, 256)] int32 zeros: the mixed decode shrink's
                                 # arrival counters (kernels/lora/mixed.py), which
                                 # every launch leaves zero
    num_tokens: int
    num_slots: int
    # the prefill path's tile lists by block size, built on first use (kernels/lora/segment.py)
    tiles: dict = field(default_factory=dict, compare=False, repr=False)


def build_meta(token_slots: torch.Tensor, num_slots: int) -> LoRAMeta:
    """Group the step's tokens by adapter slot (-1 = no adapter). Device ops only."""
    if token_slots.dim() != 1:
        raise ValueError(f"token_slots must be 1-D [T], got shape {tuple(token_slots.shape)}")
    if num_slots < 1:
        raise ValueError(f"num_slots={num_slots}: must be >= 1")
    dev = token_slots.device
    key = torch.where(token_slots < 0, num_slots, token_slots.long())
    key_sorted, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    # slots with tokens first (in slot order), then the empty ones
    by_activity = torch.sort((counts[:num_slots] == 0).to(torch.int32), stable=True).indices
    seg_len = counts[by_activity]
    active = torch.where(seg_len > 0, by_activity, torch.full_like(by_activity, -1))
    return LoRAMeta(sorted_tokens=order.to(torch.int32), active_slots=active.to(torch.int32),
                    seg_start=starts[by_activity].to(torch.int32),
                    seg_len=seg_len.to(torch.int32),
                    sorted_slots=torch.where(key_sorted == num_slots, -1,
                                             key_sorted).to(torch.int32),
                    counters=torch.zeros(4 * min(token_slots.shape[0],
                                                 TOKEN_PATH_MAX_TOKENS),
                                         dtype=torch.int32, device=dev),
                    num_tokens=token_slots.shape[0], num_slots=num_slots)


def check_call(y, x, a, b, token_slots, slice_offsets, meta):
    """ValueError naming what does not fit in an add_lora call's shapes."""
    T, Kdim = x.shape
    L, S, R, Ka = a.shape
    if Ka != Kdim:
        raise ValueError(f"x has width {Kdim} but a [L, S, R, K] has K={Ka}")
    if len(slice_offsets) != S + 1 or slice_offsets[0] != 0:
        raise ValueError(f"slice_offsets={slice_offsets}: need S+1={S + 1} ints from 0")
    if S > MAX_SLICES:
        raise ValueError(f"a has {S} slices; the kernels handle at most {MAX_SLICES}")
    if any(hi < lo for lo, hi in zip(slice_offsets, slice_offsets[1:])):
        raise ValueError(f"slice_offsets={slice_offsets} must not decrease")
    if b.shape != (L, slice_offsets[-1], R):
        raise ValueError(f"b has shape {tuple(b.shape)}, expected {(L, slice_offsets[-1], R)}")
    if y.shape != (T, slice_offsets[-1]):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {(T, slice_offsets[-1])}")
    if token_slots.shape != (T,):
        raise ValueError(f"token_slots has shape {tuple(token_slots.shape)}, expected ({T},)")
    if meta is not None and (meta.num_tokens != T or meta.num_slots != L):
        raise ValueError(f"meta was built for T={meta.num_tokens}, L={meta.num_slots}; "
                         f"this call has T={T}, L={L}")
