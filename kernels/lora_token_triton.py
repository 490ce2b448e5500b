"""Host wrappers of the token-sized LoRA kernels (kernels/lora_token_kernels_triton.py):
the decode path of `kernels.lora_triton.add_lora`, two launches per layer group.

Grids come from static sizes only (token count, slices, K and N), so the launches are
capturable in CUDA graphs; the groups' contents are read on the device from `LoRAMeta`.
"""
from __future__ import annotations

import torch
import triton

from kernels import lora_token_kernels_triton as K

GROUP = 16                 # sorted tokens per group: a uniform group is one 16-row product
_TARGET_PROGRAMS = 1024    # shrink programs wanted in flight (a few per SM)
_MIN_K_CHUNK = 512         # below this a split-K program is mostly prologue
_MAX_SPLIT_K = 8           # the expand adds SPLIT_K partials per token: keep that short


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _tile(block_r: int) -> int:
    # a [tile, BLOCK_R] float32 register tile of about 4096 values (32 per thread at 4 warps)
    return max(32, min(256, 4096 // block_r))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def default_split_k(T: int, S: int, Kdim: int) -> int:
    """Split K so that about _TARGET_PROGRAMS programs stream A, each >= _MIN_K_CHUNK wide."""
    return max(1, min(_MAX_SPLIT_K, Kdim // _MIN_K_CHUNK, -(-_TARGET_PROGRAMS // (T * S))))


def lora_shrink_tokens(x: torch.Tensor, a: torch.Tensor, meta, ranks: torch.Tensor | None = None,
                       split_k: int | None = None) -> torch.Tensor:
    """Split-K partial sums hp [SPLIT_K, S, T, R] (float32) of x[t] @ a[slot(t), s].T.

    Rows of tokens without a slot are left unwritten (the expand never reads them)."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    split_k = split_k or default_split_k(T, S, Kdim)
    hp = torch.empty((split_k, S, T, R), dtype=torch.float32, device=x.device)
    block_r = _block_r(R)
    grid = (triton.cdiv(T, GROUP), min(GROUP, T), S * split_k)
    K.lora_shrink_tok_kernel[grid](
        x, a, hp, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len, T, Kdim, R,
        x.stride(0), x.stride(1), *a.stride(), *hp.stride(),
        HAS_RANKS=ranks is not None, SPLIT_K=split_k, GROUP=GROUP, BLOCK_R=block_r,
        BLOCK_K=_tile(block_r), PRECISION=_precision(a), UPCAST=x.is_cpu)
    return hp


def lora_expand_tokens(hp: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta,
                       offsets: list[int], num_slices: int,
                       ranks: torch.Tensor | None = None,
                       block_n: int | None = None) -> torch.Tensor:
    """y[t, slice s] += (sum of hp's partials)[s, t] @ b[slot(t), slice s].T, in place.

    offsets: the slice bounds padded to five entries (lora_triton._offsets)."""
    split_k, S, T, R = hp.shape
    block_r = _block_r(R)
    block_n = block_n or _tile(block_r)
    widest = max(hi - lo for lo, hi in zip(offsets[:num_slices], offsets[1:num_slices + 1]))
    n_blocks = max(1, triton.cdiv(widest, block_n))
    grid = (triton.cdiv(T, GROUP), min(GROUP, T), num_slices * n_blocks)
    K.lora_expand_tok_kernel[grid](
        hp, b, y, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len, T, R, n_blocks, *offsets,
        *hp.stride(), *b.stride(), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, SPLIT_K=split_k, GROUP=GROUP, BLOCK_R=block_r,
        BLOCK_N=block_n, PRECISION=_precision(b), UPCAST=y.is_cpu)
    return y
