"""Host wrappers of kernels/elementwise_kernels_triton.py (CUDA, or the interpreter)."""
from __future__ import annotations

import torch
import triton

from loramux_kernels import elementwise_kernels_triton as K


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> [T, N] in x's dtype (Hugging Face LlamaRMSNorm numerics)."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == (x.shape[1],)
    out = torch.empty_like(x)
    if x.shape[0]:
        K.rms_norm_kernel[(x.shape[0],)](x, weight, out, x.shape[1], x.stride(0), out.stride(0),
                                         eps, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]."""
    assert x.dim() == 2 and x.stride(-1) == 1 and x.shape[1] % 2 == 0
    inter = x.shape[1] // 2
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if x.shape[0]:
        K.silu_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
            x, out, inter, x.stride(0), out.stride(0), BLOCK=block)
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor):
    """Rotate q [T, H, D] and k [T, KVH, D] in place (head_dim contiguous); returns (q, k)."""
    T, H, D = q.shape
    assert k.shape[0] == T and k.shape[2] == D and q.stride(-1) == 1 and k.stride(-1) == 1
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    if T:
        K.rotary_kernel[(T, H + k.shape[1])](
            q, k, positions, cos, sin, H, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos.stride(0), HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    return q, k


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (in place, rounded to its dtype); returns (rms_norm(residual), residual)."""
    assert x.dim() == 2 and x.shape == residual.shape and weight.shape == (x.shape[1],)
    assert x.stride(-1) == 1 and residual.stride(-1) == 1
    out = torch.empty_like(residual)
    if x.shape[0]:
        K.add_rms_norm_kernel[(x.shape[0],)](
            x, residual, weight, out, x.shape[1], x.stride(0), residual.stride(0),
            out.stride(0), eps, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, residual


def rotary_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                    v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor):
    """Rotate q [T, H, D] and k [T, KVH, D] in place and write k and v [T, KVH, D] to
    the paged caches [blocks, block_size, KVH, D] at slot_mapping (< 0: skipped), one
    launch; returns (q, k)."""
    T, H, D = q.shape
    kvh = k.shape[1]
    assert k.shape == (T, kvh, D) and v.shape == k.shape and D % 2 == 0
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert cos.stride(-1) == 1 and cos.stride() == sin.stride()
    assert k_cache.shape[2:] == (kvh, D) and v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and slot_mapping.shape == (T,)
    if T:
        K.rotary_store_kv_kernel[(T, H + kvh)](
            q, k, v, positions, cos, sin, slot_mapping, k_cache, v_cache, H,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
            KV_BLOCK=k_cache.shape[1], HALF=D // 2, BLOCK=triton.next_power_of_2(D // 2))
    return q, k
