"""Host wrappers of the token-sized LoRA kernels (kernels/lora_token_kernels_triton.py):
the decode path of `kernels.lora_triton.add_lora`, two launches per layer group.

Grids come from static sizes only (token count, slices, K and N), so the launches are
capturable in CUDA graphs; the groups' contents are read on the device from `LoRAMeta`.
"""
from __future__ import annotations

import torch
import triton

from kernels import lora_token_kernels_triton as K

SUB = 16                   # sub-group rows (tl.dot needs >= 16)
_TARGET_PROGRAMS = 2048    # per-token programs wanted per launch (about 16 per SM)
_MIN_K_CHUNK = 512         # below this a split-K program is mostly prologue
_MAX_SPLIT_K = 32          # up to 16 tokens (down at 1 token wants 28 splits) ...
_MAX_SPLIT_K_WIDE = 8      # ... above: every expand program of a token re-adds the partials
_MAX_SLICES = 4            # the expand kernels take five slice bounds


def _offsets(slice_offsets) -> list[int]:
    """The S+1 slice bounds padded to _MAX_SLICES+1 entries (repeating the last)."""
    offs = list(slice_offsets)
    return offs + [offs[-1]] * (_MAX_SLICES + 1 - len(offs))


def group_size(T: int) -> int:
    """Sorted tokens per group: a group that shares one slot is one GROUP-row product
    (one adapter for the whole batch reads A/B once per 64 tokens, not per 16)."""
    return 16 if T <= 16 else 32 if T <= 32 else 64


def _block_r(R: int) -> int:
    return max(16, triton.next_power_of_2(R))


def _tile(block_r: int) -> int:
    # a [tile, BLOCK_R] float32 register tile of about 4096 values (32 per thread at 4 warps)
    return max(32, min(256, 4096 // block_r))


def _precision(t: torch.Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def default_split_k(T: int, S: int, Kdim: int, uniform: bool = False) -> int:
    """Shrink split-K, measured on an H200 at rank 16 (benchmarks/sweep_lora.py):
    1 token: 16 splits, 28 for down's 14336 (one program per K chunk is all there is);
    `uniform` (every token one adapter, so GROUP-row products): 8, 16 for down;
    17..64 mixed tokens: 4 (more re-adds partials in every expand program: 64 tokens of
    qkv over 64 adapters 25.6 -> 22.7 µs); otherwise about _TARGET_PROGRAMS per-token
    programs of at least _MIN_K_CHUNK each."""
    if T == 1:
        split = max(16, Kdim // _MIN_K_CHUNK)
    elif uniform:
        split = min(16, Kdim // _MIN_K_CHUNK)
    elif 16 < T <= 64:
        split = min(4, Kdim // _MIN_K_CHUNK)
    else:
        cap = _MAX_SPLIT_K if T <= 16 else _MAX_SPLIT_K_WIDE
        split = min(cap, Kdim // _MIN_K_CHUNK, -(-_TARGET_PROGRAMS // (T * S)))
    return max(1, min(split, _MAX_SPLIT_K, Kdim // 128))


def default_n_chunks(T: int, S: int, n_tiles: int, uniform: bool = False) -> int:
    """Expand programs per (token, slice), each looping over every n_chunks-th tile;
    measured as default_split_k: `uniform` groups 4 up to 16 tokens, else one program
    per 16 tiles (the GROUP rows share each tile); 17..64 mixed tokens 4, 8 for one
    slice; otherwise about _TARGET_PROGRAMS programs."""
    if uniform and T > 1:
        chunks = 4 if T <= 16 else -(-n_tiles // 16)
    elif 16 < T <= 64:
        chunks = 4 if S > 1 else 8
    else:
        chunks = -(-_TARGET_PROGRAMS // (T * S))
    return max(1, min(n_tiles, chunks))


def lora_shrink_tokens(x: torch.Tensor, a: torch.Tensor, meta, ranks: torch.Tensor | None = None,
                       split_k: int | None = None, uniform: bool = False) -> torch.Tensor:
    """Split-K partial sums hp [SPLIT_K, S, T, R] (float32) of x[t] @ a[slot(t), s].T.

    Rows of tokens without a slot are left unwritten (the expand never reads them).
    `uniform` (a hint: the tokens likely share one adapter) only picks the tuned split."""
    T, Kdim = x.shape
    L, S, R, _ = a.shape
    split_k = split_k or default_split_k(T, S, Kdim, uniform)
    hp = torch.empty((split_k, S, T, R), dtype=torch.float32, device=x.device)
    block_r = _block_r(R)
    group = group_size(T)
    block_k = _tile(block_r)
    grid = (triton.cdiv(T, group), min(group, T), S * split_k)
    K.lora_shrink_tok_kernel[grid](
        x, a, hp, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len, T, Kdim, R,
        x.stride(0), x.stride(1), *a.stride(), *hp.stride(),
        HAS_RANKS=ranks is not None, SPLIT_K=split_k, GROUP=group, BLOCK_R=block_r,
        BLOCK_K=block_k, BLOCK_KG=max(32, min(block_k, 8192 // group)),
        PRECISION=_precision(a), UPCAST=x.is_cpu)
    return hp


def lora_expand_tokens(hp: torch.Tensor, b: torch.Tensor, y: torch.Tensor, meta,
                       offsets: list[int], num_slices: int,
                       ranks: torch.Tensor | None = None, block_n: int | None = None,
                       n_chunks: int | None = None, uniform: bool = False,
                       row_scale: torch.Tensor | None = None) -> torch.Tensor:
    """y[t, slice s] += (sum of hp's partials)[s, t] @ b[slot(t), slice s].T, in place.

    offsets: the slice bounds padded to five entries (`_offsets`); block_n and
    n_chunks (tile width, programs per token and slice) default to the tuned choice;
    row_scale [T] float32: each token's summed h is multiplied by it first (or None)."""
    split_k, S, T, R = hp.shape
    block_r = _block_r(R)
    group = group_size(T)
    block_n = block_n or _tile(block_r)
    # a GROUP-row tile keeps about 4096 float32 values per program, as the others
    block_ng = max(16, min(block_n, (block_n * SUB) // group))
    widest = max(hi - lo for lo, hi in zip(offsets[:num_slices], offsets[1:num_slices + 1]))
    n_chunks = n_chunks or default_n_chunks(T, num_slices, max(1, triton.cdiv(widest, block_n)),
                                        uniform)
    grid = (triton.cdiv(T, group), min(group, T), num_slices * n_chunks)
    K.lora_expand_tok_kernel[grid](
        hp, b, y, meta.sorted_tokens, meta.sorted_slots,
        ranks if ranks is not None else meta.seg_len,
        row_scale if row_scale is not None else hp, T, R, n_chunks, *offsets,
        *hp.stride(), *b.stride(), y.stride(0), y.stride(1),
        HAS_RANKS=ranks is not None, HAS_SCALE=row_scale is not None, SPLIT_K=split_k,
        GROUP=group, BLOCK_R=block_r,
        BLOCK_N=block_n, BLOCK_NG=block_ng, PRECISION=_precision(b), UPCAST=y.is_cpu)
    return y
