"""Dispatch for the decoder's small per-token ops (RMSNorm, residual add + RMSNorm,
SiLU-and-multiply, rotary, rotary + KV-cache store):
one Triton launch each on CUDA (a decode step is launch-bound there: the torch forms cost
5-16 launches apiece), the torch reference elsewhere. Chosen by the tensor's device."""
from __future__ import annotations

import torch

from loramux_kernels.attention_ref import store_kv_ref
from loramux_kernels.elementwise_ref import add_rms_norm_ref, rms_norm_ref, rotary_ref, silu_mul_ref

try:
    from loramux_kernels import elementwise_triton as _triton
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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); on CUDA one launch, residual updated in place."""
    if (_gpu(x) and x.dim() == 2 and x.shape == residual.shape and x.stride(-1) == 1
            and residual.stride(-1) == 1):
        return _triton.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    """Rotate (q, k), then write k and v to the paged KV caches at slot_mapping (< 0:
    skipped); returns (q, k). On CUDA one launch, q and k rotated in place."""
    if (_gpu(q) and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1):
        return _triton.rotary_store_kv(positions, q, k, v, cos, sin, k_cache, v_cache,
                                       slot_mapping)
    q, k = rotary_ref(positions, q, k, cos, sin)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping)
    return q, k
