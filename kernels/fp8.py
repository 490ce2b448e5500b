"""Linear layers over FP8 weights: y = x · (W_fp8 · s_w)ᵀ with one float32 scale per
weight row (a per-tensor scale is the same value on every row).

`fp8_linear` quantizes x per token (dynamic: s_x = max|x_t| / 448) and runs the FP8
GEMM with both row-wise scales (torch._scaled_mm; Hopper's FP8 tensor cores on CUDA);
`dequant_linear_ref` is the plain reference: the weight dequantized, x unquantized.

On CUDA the activation quantization is one Triton launch (kernels/fp8_triton.py), not the
nine small torch ops of `quantize_rows`: at decode sizes a GEMM is a few microseconds of
GPU work, and the launches around it would cost more than the GEMM. The weight needs no
work per call: it is kept [N, K] row-major, so `weight.t()` is the column-major [K, N]
operand _scaled_mm wants, and its float32 scale [N] is viewed as [1, N].
"""
from __future__ import annotations

import functools

import torch

try:  # the Triton module is optional: absent on machines without Triton
    from loramux_kernels import fp8_triton as _triton
except ImportError:
    _triton = None

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)   # 448


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [M, K], scale [M, 1] float32) with x ≈ x_fp8 · scale, one scale per row."""
    scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] · (weight [N, K] fp8 · weight_scale [N])ᵀ -> [M, N] in x's dtype."""
    N, K = weight.shape
    if K % 16 or N % 16 or x.shape[0] == 0:   # _scaled_mm's alignment
        return dequant_linear_ref(x, weight, weight_scale)
    xq, xs = (_triton.quantize_rows(x, FP8_MAX) if x.is_cuda and _triton is not None
              else quantize_rows(x))
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    if not x.is_cuda and not _cpu_takes_row_scales():
        w = weight.float() * weight_scale.float().unsqueeze(1)
        return ((xq.float() * xs) @ w.t()).to(x.dtype)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1),
                         out_dtype=out_dtype)
    return y if y.dtype == x.dtype else y.to(x.dtype)


@functools.cache
def _cpu_takes_row_scales() -> bool:
    """Whether this torch's CPU _scaled_mm takes a scale per row (older releases take one
    per tensor only and fail an internal assert); asked once. Without: the same product
    of the quantized x and the FP8 weight, in float32 (an emulation, for the CPU only)."""
    a, b = torch.ones(2, 16).to(FP8), torch.ones(16, 16).to(FP8)
    try:
        torch._scaled_mm(a, b.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError):
        return False
    return True


def dequant_linear_ref(x: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor) -> torch.Tensor:
    """The same product with the weight dequantized and x as it is."""
    w = weight.float() * weight_scale.float().unsqueeze(1)
    return torch.nn.functional.linear(x, w.to(x.dtype))
