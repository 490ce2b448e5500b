"""Paged attention entry points: the model calls these, they pick the implementation by
the tensors' device. CPU: the torch reference (kernels/attention_ref.py). CUDA: the Triton
kernels of kernels/attention_triton.py when that module imports, else the reference.

The choice depends only on the device, never on environment variables, so the hot path
does no lookups beyond one cached import.
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from loramux_kernels.attention_metadata import AttentionMetadata
from loramux_kernels.attention_ref import paged_attention_ref, store_kv_ref


@functools.lru_cache(maxsize=1)
def _triton_module() -> ModuleType | None:
    """loramux_kernels.attention_triton if it imports and has both entry points, else None."""
    try:
        mod = importlib.import_module("loramux_kernels.attention_triton")
    except ImportError:
        return None
    if not (hasattr(mod, "store_kv") and hasattr(mod, "paged_attention")):
        return None
    return mod


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write new K/V [T, KVH, D] into the paged caches at `slot_mapping` (slots < 0 skipped)."""
    mod = _triton_module() if k.is_cuda else None
    if mod is not None:
        mod.store_kv(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of q [T, H, D] over each sequence's paged context -> [T, H, D].

    `window`: a token at position p sees only positions > p - window (sliding-window
    attention), on either implementation."""
    mod = _triton_module() if q.is_cuda else None
    if mod is not None:
        return mod.paged_attention(q, k_cache, v_cache, attn, scale, window=window)
    return paged_attention_ref(q, k_cache, v_cache, attn.positions, attn.query_start_loc,
                               attn.seq_lens, attn.block_tables, scale, window)
