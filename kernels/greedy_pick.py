"""Dispatch of the greedy pick (each row's argmax token and its raw logprob): the Triton
kernel (kernels/greedy_pick_triton.py: one read of the logits) when asked for and the
logits are on CUDA, the torch reference (kernels/greedy_pick_ref.py: a float32 copy,
argmax, log_softmax, gather) otherwise."""
from __future__ import annotations

import torch

from loramux_kernels.greedy_pick_ref import greedy_pick_ref

try:
    from loramux_kernels import greedy_pick_triton as _triton
except ImportError:  # no Triton on this machine
    _triton = None


def _gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton is not None


def greedy_pick(logits: torch.Tensor, kernel: bool = False) -> torch.Tensor:
    """logits [B, V] -> [2, B] float64: argmax token id (the first of equal maxima) and
    logit[argmax] - logsumexp(row), in float32. `kernel`: through the Triton kernel where
    it runs (same tokens; logprobs within float32 rounding of the reference's)."""
    if kernel and _gpu(logits) and logits.dim() == 2 and logits.stride(-1) == 1:
        return _triton.greedy_pick(logits)
    return greedy_pick_ref(logits)
