"""Applying a constrained rows' token bitmask (engine/structured/masks.py) to logits."""
from __future__ import annotations

import torch

def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor,
                        bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [B, V] with every token of row rows[k] whose bit is 0 in bitmask[k]
    ([R, W] int32, bit t % 32 of word t // 32) set to -inf, in place. Ids at or past 32 * W
    (the model's padding rows past the tokenizer's vocabulary) are never allowed. Rows
    not in `rows` are untouched."""
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> bits) & 1).bool()
    allowed = allowed.view(bitmask.shape[0], -1)
    if allowed.shape[1] >= vocab:
        allowed = allowed[:, :vocab]
    else:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    masked = logits.index_select(0, rows).masked_fill_(~allowed, float("-inf"))
    return logits.index_copy_(0, rows, masked)
