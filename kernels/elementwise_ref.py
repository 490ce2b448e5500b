"""Torch references of the decoder's small per-token ops, with the exact rounding of
Hugging Face transformers (the CPU path, and the oracle of the Triton kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back to x's dtype, then multiply by the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a decoder layer's residual add, then the
    next RMSNorm (the new residual is a new tensor; the Triton form writes it in place)."""
    residual = residual + x
    return rms_norm_ref(residual, weight, eps), residual


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] -> silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_ref(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor):
    """New rotated (q, k); cos/sin [max_pos, D] float32 tables, cast to the activations'
    dtype before use, as transformers does."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)

    def rot(x):
        cc, ss = c.to(x.dtype), s.to(x.dtype)
        return x * cc + rotate_half(x) * ss
    return rot(q), rot(k)
