"""Per-token FP8 quantization of activations in one launch (kernels/fp8.py): each
program reads one row, takes its amax, and writes the row in float8_e4m3fn with its
float32 scale max|x| / 448 (at least 1e-12 / 448)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                         FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # IEEE division (tl.div_rn), as torch divides: `/` may compile to an approximate one
    scale = tl.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), FP8_MAX)
    tl.store(s_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)


def quantize_rows(x: torch.Tensor, fp8_max: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_fp8 [M, K], scale [M, 1] float32) of x [M, K] (last dim contiguous)."""
    M, K = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, 1, dtype=torch.float32, device=x.device)
    if M:
        quantize_rows_kernel[(M,)](x, q, s, K, x.stride(0), q.stride(0), FP8_MAX=fp8_max,
                                   BLOCK_K=min(1024, triton.next_power_of_2(K)))
    return q, s
