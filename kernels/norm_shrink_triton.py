"""Host wrapper of the add + RMSNorm + LoRA shrink launch
(kernels/norm_shrink_kernels_triton.py), and the expand that finishes it or any shrink
fused into the op that makes a group's input (kernels/silu_shrink_triton.py too).

`add_rms_norm_shrink` returns the norm's output, the new residual and a `FusedShrunk`
(unscaled split-K partials and each row's 1/rms); `expand_fused_shrunk` adds the LoRA
delta to the group's matmul output with the token-sized expand kernel
(kernels/lora_token_triton.py), which scales each row's h by its 1/rms. Grids come from
static sizes only (tokens, slices, K), so both launches are capturable in CUDA graphs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels import norm_shrink_kernels_triton as K
from kernels.lora_token_triton import (_MAX_SLICES, _block_r, _offsets, default_split_k,
                                       lora_expand_tokens)

MAX_TOKENS = 256           # the decode path (kernels/lora_triton.py TOKEN_PATH_MAX_TOKENS)
BLOCK_M = 16               # rows per shrink program (tl.dot needs 16)
_MIN_K_CHUNK = 128
_MIXED_PROGRAMS = 512      # one-row shrink programs wanted for a mixed batch (about four
                           # per SM: each reads its own adapter's A chunk)
_MAX_SPLIT_K = 32
MAX_FUSED_COLUMNS = 512    # S·R of one program's A tile (padded to a power of two): wider,
                           # a tl.dot block of it no longer fits shared memory (q/k/v at rank
                           # 256 in float32 asks 262 KB of sm_90's 227 KB); such groups take
                           # the plain op and the token shrink, which tiles one slice at a time


@dataclass(frozen=True)
class FusedShrunk:
    """What a shrink fused into the op before it leaves for `expand_fused_shrunk`."""
    hp: torch.Tensor              # [split_k, S, T, R] float32 partials (of unscaled rows)
    rstd: torch.Tensor | None     # [T] float32: 1/rms of each row, scales h in the expand
    slice_offsets: tuple[int, ...]
    ranks: torch.Tensor | None
    uniform: bool


def fits(slices: int, rank: int) -> bool:
    """Whether a group of `slices` slices of rank `rank` may run its shrink fused into
    the op before it (MAX_FUSED_COLUMNS)."""
    return _block_r(slices * rank) <= MAX_FUSED_COLUMNS


def split_k(T: int, S: int, Kdim: int, uniform: bool) -> int:
    """K chunks per row block. `uniform`: the token shrink's tuned split (the expand then
    sums as many partials as it does after that shrink); a mixed batch (one row per
    program): about _MIXED_PROGRAMS programs, a power of two (few compiled variants of the
    expand, which unrolls its sum over them)."""
    if uniform:
        return default_split_k(T, S, Kdim, uniform=True)
    want = -(-_MIXED_PROGRAMS // T)
    split = max(1, min(want, _MAX_SPLIT_K, Kdim // _MIN_K_CHUNK))
    return 1 << (split.bit_length() - 1)


def default_block_k(block_sr: int, k_chunk: int, per_row: bool) -> int:
    """An [BLOCK_K, BLOCK_SR] A tile of about 8K values for a one-row program, 4K beside
    a block's [BLOCK_M, BLOCK_K] rows of at most 2K (sm_90, bf16, 4 warps: q/k/v at rank
    16 125 and 207 registers, the SiLU block 155; 8K A values or 4K rows in a block
    program take all 255)."""
    if per_row:
        return max(32, min(256, 8192 // block_sr, triton.next_power_of_2(k_chunk)))
    return max(32, min(2048 // BLOCK_M, 4096 // block_sr, triton.next_power_of_2(k_chunk)))


def add_rms_norm_shrink(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, a: torch.Tensor, token_slots: torch.Tensor,
                        slice_offsets: tuple[int, ...], ranks: torch.Tensor | None = None,
                        uniform: bool = False, splits: int | None = None,
                        block_k: int | None = None, num_warps: int = 4
                        ) -> tuple[torch.Tensor, torch.Tensor, FusedShrunk]:
    """(rms_norm(residual + x), residual + x, the LoRA shrink of the first) in one launch.

    x None: rms_norm(residual) and residual itself (nothing added). The new residual is a
    new tensor (the shrink programs read the old one meanwhile). x, residual [T, N]
    (rows contiguous); weight [N]; a [L, S, R, N]; token_slots [T] (-1: no adapter);
    ranks [L] int32 or None (then R); uniform: a hint that the rows share one adapter
    (BLOCK_M-row matrix products; otherwise one row per shrink program: the result is the
    same); splits, block_k, num_warps: launch parameters (defaults: `split_k`,
    `default_block_k`, 4 as the plain norm; benchmarks/bench_norm_shrink.py --sweep tries
    others)."""
    T, N = residual.shape
    L, S, R, Ka = a.shape
    assert 0 < T <= MAX_TOKENS and 0 < S <= _MAX_SLICES and Ka == N, (T, S, Ka, N)
    assert residual.stride(-1) == 1 and weight.shape == (N,) and weight.stride(0) == 1
    assert x is None or (x.shape == residual.shape and x.stride(-1) == 1)
    assert token_slots.shape == (T,) and len(slice_offsets) == S + 1
    splits = splits or split_k(T, S, N, uniform)
    block_sr = _block_r(S * R)
    block_k = block_k or default_block_k(block_sr, triton.cdiv(N, splits), not uniform)
    k_chunk = triton.cdiv(triton.cdiv(N, splits), block_k) * block_k
    splits = triton.cdiv(N, k_chunk)                 # no empty chunk
    out = torch.empty_like(residual)
    res_out = torch.empty_like(residual) if x is not None else residual
    rstd = torch.empty(T, dtype=torch.float32, device=residual.device)
    hp = torch.empty((splits, S, T, R), dtype=torch.float32, device=residual.device)
    grid = (T + (triton.cdiv(T, BLOCK_M) if uniform else T) * splits,)
    K.add_rms_norm_shrink_kernel[grid](
        x if x is not None else residual, residual, weight, out, res_out, rstd, a, hp,
        token_slots, ranks if ranks is not None else token_slots, T, N, R, S * R, k_chunk,
        eps, (x if x is not None else residual).stride(0), residual.stride(0), out.stride(0),
        res_out.stride(0), *a.stride(), *hp.stride(),
        HAS_ADD=x is not None, HAS_RANKS=ranks is not None, SPLIT_K=splits,
        BLOCK=triton.next_power_of_2(N), BLOCK_M=BLOCK_M, BLOCK_K=block_k,
        BLOCK_SR=block_sr, PER_ROW=not uniform,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        UPCAST=residual.device.type == "cpu", num_warps=num_warps)
    shrunk = FusedShrunk(hp, rstd, tuple(int(o) for o in slice_offsets), ranks, uniform)
    return out, res_out, shrunk


def expand_fused_shrunk(shrunk: FusedShrunk, b: torch.Tensor, y: torch.Tensor,
                        meta) -> torch.Tensor:
    """y [T, N] += (1/rms · h) · B[slot]ᵀ per slice from a finished `add_rms_norm_shrink`
    (h · B[slot]ᵀ where there is no row scale), in place (after it in stream order);
    meta: the step's `LoRAMeta`. Returns y."""
    offs = shrunk.slice_offsets
    return lora_expand_tokens(shrunk.hp, b, y, meta, _offsets(offs), len(offs) - 1, shrunk.ranks,
                              uniform=shrunk.uniform, row_scale=shrunk.rstd)
