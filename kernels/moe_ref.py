"""Plain-torch reference for a mixture-of-experts MLP: top-k routing and grouped GEMMs.

The routed work is a list of P = T·k (token, expert) pairs, pair p = t·k + j for the j-th
expert of token t. Every GEMM of the experts is a *grouped* GEMM over those pairs: row p
of the output is `a[p // a_row_div] @ w[group[p]]ᵀ`, where `group[p]` picks the weight
(an expert, or an (adapter slot, expert) for expert LoRA) and a negative group skips the
row. The Triton kernels (kernels/moe_triton.py) compute the same thing; kernels/moe.py
chains the stages.
"""
from __future__ import annotations

import torch


def route_ref(router_logits: torch.Tensor, top_k: int,
              norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in the logits' dtype, expert ids [T, k] int64): softmax in float32
    over all experts, the k largest, optionally renormalised to sum to one (transformers'
    Qwen2-MoE / Qwen3-MoE / Mixtral routers)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids


def grouped_gemm_ref(a: torch.Tensor, w: torch.Tensor, group: torch.Tensor, a_row_div: int,
                     out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """out[p] (+)= a[p // a_row_div] @ w[group[p]]ᵀ for every pair p with group[p] >= 0
    (rows with a negative group are left as they are); returns out.

    a: [M, K]; w: [G, N, K]; group: [P] int; out: [P, N]. The product is computed in
    float32 (w's dtype when that is wider) and cast to out's dtype."""
    rows = torch.arange(group.numel(), device=group.device)
    for g in torch.unique(group).tolist():   # the reference loops over groups present
        if g < 0:
            continue
        p = rows[group == g]
        prod = a[p // a_row_div].float() @ w[g].float().T
        if accumulate:
            prod += out[p].float()
        out[p] = prod.to(out.dtype)
    return out


def pair_groups(topk_ids: torch.Tensor, token_slots: torch.Tensor,
                num_experts: int) -> torch.Tensor:
    """Group of each pair for expert LoRA: slot·E + expert, -1 for base-model tokens.
    topk_ids: [T, k]; token_slots: [T]."""
    k = topk_ids.shape[1]
    slots = token_slots.long().repeat_interleave(k)
    return torch.where(slots >= 0, slots * num_experts + topk_ids.reshape(-1), -1)
