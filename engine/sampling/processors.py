"""Vectorised logits processors for a batch of rows with different parameters.

Each one matches the Hugging Face processor of the same name (transformers'
generation/logits_process.py) row by row, and HF's order is kept by the sampler:
repetition penalty, then temperature, top-k, top-p, min-p. Removed tokens get -inf.
"""
from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def apply_repetition_penalty(logits: torch.Tensor, rows: torch.Tensor,
                             seen_ids: list[list[int]], penalty: torch.Tensor) -> torch.Tensor:
    """For each batch row rows[i], every token id in seen_ids[i] gets its logit divided by
    penalty[i] if positive, multiplied if negative (HF RepetitionPenaltyLogitsProcessor).
    Returns a new tensor; ids outside the vocabulary are ignored."""
    vocab = logits.shape[-1]
    width = max(1, max(len(ids) for ids in seen_ids))
    padded = torch.full((len(seen_ids), width), vocab, dtype=torch.long)
    for i, ids in enumerate(seen_ids):
        if ids:
            padded[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    padded = padded.clamp_(0, vocab).to(logits.device, non_blocking=True)
    mask = torch.zeros((len(seen_ids), vocab + 1), dtype=torch.bool, device=logits.device)
    mask.scatter_(1, padded, True)
    sub = logits[rows]
    p = penalty[:, None]
    penalised = torch.where(sub < 0, sub * p, sub / p)
    out = logits.clone()
    out[rows] = torch.where(mask[:, :vocab], penalised, sub)
    return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor) -> torch.Tensor:
    """HF TopKLogitsWarper then TopPLogitsWarper per row, with one sort.

    top_k[i] in [1, V] (V = off) keeps every token >= the k-th largest (ties kept);
    top_p[i] in (0, 1] removes the ascending-sorted tokens whose cumulative probability
    (after top-k) is <= 1 - top_p, always keeping the most likely one."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
    kth = sorted_logits.gather(1, (vocab - top_k).clamp(0, vocab - 1)[:, None])
    remove = sorted_logits < kth
    # Removed tokens are the smallest, so they sit at the front and the order stays sorted.
    sorted_logits = sorted_logits.masked_fill(remove, _NEG_INF)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove |= cumulative <= (1 - top_p)[:, None]
    remove[:, -1] = False
    mask = torch.empty_like(remove).scatter_(1, order, remove)
    return logits.masked_fill(mask, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """HF MinPLogitsWarper per row: remove tokens whose probability is below
    min_p[i] * (the row's top probability); min_p 0 = off."""
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    remove = probs < threshold
    remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
    return logits.masked_fill(remove, _NEG_INF)
