"""Plain-torch reference for paged attention over a mixed batch of prefill chunks and
decodes (see engine/model/batch.py for the flat layout).

KV cache of one layer: k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
"""
from __future__ import annotations

import torch


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
                        scale: float) -> torch.Tensor:
    """Causal attention of new tokens q [T, H, D] over their sequence's cached context
    (which already holds the new tokens' K/V). Returns [T, H, D] in q's dtype.

    Every token gathers its own sequence's context through the block table and masks
    context positions greater than its own position; computed in float32."""
    T, H, D = q.shape
    nb, bs, kvh, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_of_tok = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    max_ctx = block_tables.shape[1] * bs
    # [B, max_ctx] flat slot of each context position of each sequence
    offs = torch.arange(max_ctx, device=q.device)
    slots = block_tables.long()[:, offs // bs] * bs + offs % bs
    k = k_cache.view(nb * bs, kvh, D)[slots].float()  # [B, C, KVH, D]
    v = v_cache.view(nb * bs, kvh, D)[slots].float()
    # Slots past a sequence's length (tail of its last block, padding entries of the
    # block table) hold whatever the pool last had, possibly inf/NaN; a zero softmax
    # weight does not cancel those (0 * NaN = NaN), so they are zeroed here.
    valid = (offs.view(1, -1) < seq_lens.long().view(-1, 1)).view(num_seqs, max_ctx, 1, 1)
    k = k.masked_fill(~valid, 0.0)
    v = v.masked_fill(~valid, 0.0)
    group = H // kvh
    k = k.repeat_interleave(group, dim=2)            # [B, C, H, D]
    v = v.repeat_interleave(group, dim=2)
    kt = k[seq_of_tok]                               # [T, C, H, D]
    vt = v[seq_of_tok]
    scores = torch.einsum("thd,tchd->thc", q.float(), kt) * scale
    ctx_pos = offs.view(1, -1)
    allowed = (ctx_pos <= positions.view(-1, 1)) & (ctx_pos < seq_lens.long()[seq_of_tok].view(-1, 1))
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thc,tchd->thd", probs, vt)
    return out.to(q.dtype)
