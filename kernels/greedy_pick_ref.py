"""The greedy pick in plain torch: each row's argmax token and its raw logprob, with the
Sampler's own ops for a greedy row without penalty (engine/sampling). The CPU path and
the oracle of kernels/greedy_pick_triton.py."""
from __future__ import annotations

import torch


def greedy_pick_ref(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] -> [2, B] float64: argmax token id (the first of equal maxima) and
    its log-softmax, both over the float32 logits."""
    logits = logits.float()
    tok = logits.argmax(dim=-1)
    lp = torch.log_softmax(logits, dim=-1).gather(1, tok[:, None])[:, 0]
    return torch.stack([tok.double(), lp.double()])
