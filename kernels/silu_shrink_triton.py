"""Host wrapper of the SiLU-and-multiply + LoRA shrink launch
(kernels/silu_shrink_kernels_triton.py); `kernels.norm_shrink_triton.expand_fused_shrunk`
finishes it. The grid comes from static sizes only (tokens, K), so the launch is
capturable in CUDA graphs.
"""
from __future__ import annotations

import torch
import triton

from kernels import silu_shrink_kernels_triton as K
from kernels.lora_token_triton import _block_r
from kernels.norm_shrink_triton import (BLOCK_M, MAX_TOKENS, FusedShrunk, default_block_k,
                                        split_k)


def silu_mul_shrink(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor,
                    slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                    uniform: bool = False, splits: int | None = None,
                    block_k: int | None = None, num_warps: int = 4
                    ) -> tuple[torch.Tensor, FusedShrunk]:
    """(silu(gate) * up, the LoRA shrink of it) in one launch, x = [gate | up] [T, 2I]
    (rows contiguous); a [L, 1, R, I] (one slice: down_proj); token_slots [T] (-1: no
    adapter); slice_offsets (0, N) of the expand's output; ranks [L] int32 or None (then
    R); uniform: a hint that the rows share one adapter (BLOCK_M-row matrix products;
    otherwise one row per program: the result is the same); splits, block_k, num_warps:
    launch parameters (defaults as kernels/norm_shrink_triton.py)."""
    T, two_i = x.shape
    L, S, R, I = a.shape
    assert 0 < T <= MAX_TOKENS and S == 1 and two_i == 2 * I and x.stride(-1) == 1, \
        (T, S, two_i, I)
    assert token_slots.shape == (T,) and len(slice_offsets) == 2
    splits = splits or split_k(T, 1, I, uniform)
    block_r = _block_r(R)
    block_k = block_k or default_block_k(block_r, triton.cdiv(I, splits), not uniform)
    k_chunk = triton.cdiv(triton.cdiv(I, splits), block_k) * block_k
    splits = triton.cdiv(I, k_chunk)                 # no empty chunk
    out = torch.empty((T, I), dtype=x.dtype, device=x.device)
    hp = torch.empty((splits, 1, T, R), dtype=torch.float32, device=x.device)
    grid = ((triton.cdiv(T, BLOCK_M) if uniform else T) * splits,)
    K.silu_mul_shrink_kernel[grid](
        x, out, a, hp, token_slots, ranks if ranks is not None else token_slots,
        T, I, R, k_chunk, x.stride(0), out.stride(0), a.stride(0), a.stride(2), a.stride(3),
        hp.stride(0), hp.stride(2), hp.stride(3),
        HAS_RANKS=ranks is not None, SPLIT_K=splits, BLOCK_M=BLOCK_M, BLOCK_K=block_k,
        BLOCK_R=block_r, PER_ROW=not uniform,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=x.device.type == "cpu", num_warps=num_warps)
    shrunk = FusedShrunk(hp, None, tuple(int(o) for o in slice_offsets), ranks, uniform)
    return out, shrunk
