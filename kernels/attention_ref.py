"""Plain-torch reference for paged attention over a mixed batch of prefill chunks and
decodes (see engine/model/batch.py for the flat layout).

KV cache of one layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([T, KVH, D]) to its slot; slots < 0 are skipped."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    nb, bs = k_cache.shape[0], k_cache.shape[1]
    k_cache.view(nb * bs, *k_cache.shape[2:])[slots] = k[keep].to(k_cache.dtype)
    v_cache.view(nb * bs, *v_cache.shape[2:])[slots] = v[keep].to(v_cache.dtype)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        positions: torch.Tensor, query_start_loc: torch.Tensor,
                        seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens q [T, H, D] over their sequence's cached context
    (which already holds the new tokens' K/V). Returns [T, H, D] in q's dtype. With
    `window`, a token at position p sees only context positions > p - window.

    One sequence at a time: gather its context [L, KVH, D] through its block table (only
    its first seq_len slots: the tail of the last block may hold anything, NaN included)
    and run torch's scaled-dot-product attention in float32, each new token seeing the
    context positions up to its own. Memory is one sequence's context and scores, never
    a [tokens, context, heads, dim] tensor (the CPU path runs long prompts through this)."""
    T, H, D = q.shape
    nb, bs, kvh, _ = k_cache.shape
    k_flat, v_flat = k_cache.view(nb * bs, kvh, D), v_cache.view(nb * bs, kvh, D)
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for b, ctx_len in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        if hi == lo:
            continue
        offs = torch.arange(ctx_len, device=q.device)
        slots = block_tables[b].long()[offs // bs] * bs + offs % bs
        k = _heads_first(k_flat[slots], H // kvh)      # [H, L, D]
        v = _heads_first(v_flat[slots], H // kvh)
        pos = positions[lo:hi].view(-1, 1)
        allowed = offs.view(1, -1) <= pos  # [n, L]
        if window is not None:
            allowed &= offs.view(1, -1) > pos - window
        # 4-d inputs: torch's fused CPU kernel (3-d ones take its unfused path)
        o = F.scaled_dot_product_attention(q[lo:hi].float().transpose(0, 1)[None], k[None],
                                           v[None], attn_mask=allowed, scale=scale)
        out[lo:hi] = o[0].transpose(0, 1).to(q.dtype)
    return out


def _heads_first(x: torch.Tensor, group: int) -> torch.Tensor:
    """[L, KVH, D] -> [KVH * group, L, D] in float32, each KV head repeated for its group
    of query heads."""
    return x.float().repeat_interleave(group, dim=1).transpose(0, 1)
