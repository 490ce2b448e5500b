"""Dispatch for the decoder's small per-token ops (RMSNorm, SiLU-and-multiply, rotary):
one Triton launch each on CUDA (a decode step is launch-bound there: the torch forms cost
5-16 launches apiece), the torch reference elsewhere. Chosen by the tensor's device."""
from __future__ import annotations

import torch

from kernels.elementwise_ref import rms_norm_ref, rotary_ref, silu_mul_ref

try:
    from kernels import elementwise_triton as _triton
except ImportError:  # no Triton on this machine
    _triton = None


def _gpu(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _gpu(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _triton.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    if _gpu(x) and x.dim() == 2 and x.stride(-1) == 1:
        return _triton.silu_mul(x)
    return silu_mul_ref(x)


def rotary(positions, q, k, cos, sin):
    """(q, k) rotated; on CUDA in place (the caller's q and k are overwritten)."""
    if _gpu(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        return _triton.rotary(positions, q, k, cos, sin)
    return rotary_ref(positions, q, k, cos, sin)
