"""Paged attention on the GPU for a mixed batch of prefill chunks and decodes.

Same semantics as `loramux_kernels.attention_ref`: each new token attends, through its sequence's
block table, to context positions 0..positions[t] (its own K/V already stored), or with a
sliding window W to positions[t] - W + 1..positions[t] only, reading no key block wholly
before that window (a variant compiled apart: WINDOW in the kernel). One kernel
serves prefill, extend (cached prefix + new tokens) and decode; decodes over long contexts
split the key range across programs and merge the partials in a second launch.

KV cache of one layer: [num_blocks, block_size, num_kv_heads, head_dim], head_dim
contiguous. No host sync: grid sizes come from the token count, the sequence count and
`AttentionMetadata.max_query_len` / `max_seq_len`, which the runner knows on the host.
"""
from __future__ import annotations

import math

import torch
import triton

from loramux_kernels import attention_kernels_triton as K
from loramux_kernels.attention_metadata import AttentionMetadata

_TARGET_PROGRAMS = 264          # about two programs per SM on an H100 (132 SMs)
_MAX_SPLITS = 64
_SCRATCH_BUDGET = 256 << 20     # bytes of split partials we accept


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write each new token's K/V ([T, KVH, D]) to cache slot slot_mapping[t] (< 0: skip)."""
    T, kvh, d = k.shape
    if v.shape != k.shape or k_cache.shape[2:] != (kvh, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, k_cache "
                         f"{tuple(k_cache.shape)}, v_cache {tuple(v_cache.shape)} do not agree")
    if slot_mapping.shape != (T,):
        raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, expected ({T},)")
    _need_unit_last_stride(k_cache=k_cache, v_cache=v_cache)
    if T == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    K.store_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping, k_cache.shape[1],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV=kvh, HEAD_D=d, BLOCK_H=triton.next_power_of_2(kvh),
        BLOCK_D=triton.next_power_of_2(d))


def _need_unit_last_stride(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last (head_dim) axis, "
                             f"got strides {t.stride()}")


def _block_q(max_query_len: int, group_pad: int) -> int:
    """Tokens per tile: a decode-only batch needs one row-block of 16 (tl.dot minimum)."""
    rows = 16 if max_query_len <= 1 else 64
    return max(1, max(rows, group_pad) // group_pad)


def _num_splits(programs: int, key_span: int, block_n: int, scratch_per_split: int) -> int:
    """Split the key range only when too few programs would otherwise stream a long one."""
    if programs >= _TARGET_PROGRAMS:
        return 1
    by_len = triton.cdiv(key_span, 4 * block_n)      # keep >= 4 key blocks per split
    by_mem = max(1, _SCRATCH_BUDGET // max(1, scratch_per_split))
    return max(1, min(_MAX_SPLITS, triton.cdiv(_TARGET_PROGRAMS, programs), by_len, by_mem))


def _key_span(attn: AttentionMetadata, block_q: int, kv_block: int, window: int | None) -> int:
    """The most keys one tile reads (at least 1): the longest context, or with a window
    the window of a tile's tokens (up to block_q consecutive positions) from the cache
    block its first token's window starts in. Host-side sizes only: no sync, and a decode
    graph's (max_seq_len = max_model_len) is fixed by the model's limits."""
    span = max(1, attn.max_seq_len)
    if window is None:
        return span
    tile_tokens = min(max(1, attn.max_query_len), block_q)
    return min(span, window + tile_tokens - 1 + kv_block - 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: AttentionMetadata, scale: float,
                    num_splits: int | None = None,
                    out: torch.Tensor | None = None,
                    window: int | None = None) -> torch.Tensor:
    """Causal attention of new tokens q [T, H, D] over their cached contexts; [T, H, D].

    num_splits: key-range splits (None: chosen from the batch shape; tests force it).
    out: optional [T, H, D] destination (head_dim contiguous), e.g. a static graph buffer.
    window: sliding window (a token at position p sees positions > p - window), or None."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 1):
        raise ValueError(f"window={window!r} must be a positive int or None")
    T, H, D = q.shape
    _, kv_block, kvh, dk = k_cache.shape
    if dk != D or H % kvh != 0 or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} does not fit k_cache {tuple(k_cache.shape)} / "
                         f"v_cache {tuple(v_cache.shape)} (need equal head_dim, H % KVH == 0)")
    if attn.num_tokens != T:
        raise ValueError(f"attn describes {attn.num_tokens} tokens, q has {T}")
    _need_unit_last_stride(k_cache=k_cache, v_cache=v_cache)
    q = q if q.stride(-1) == 1 else q.contiguous()
    if out is None:
        out = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out has shape {tuple(out.shape)} / strides {out.stride()}, "
                         f"expected {tuple(q.shape)} with a contiguous last axis")
    if T == 0:
        return out
    group = H // kvh
    group_pad = triton.next_power_of_2(group)
    block_q = _block_q(attn.max_query_len, group_pad)
    block_n = 64
    decode = attn.max_query_len <= 1 and T == attn.num_seqs   # token t is sequence t
    tiles = T if decode else triton.cdiv(T, block_q) + attn.num_seqs
    span = _key_span(attn, block_q, kv_block, window)
    if num_splits is None:
        num_splits = _num_splits(tiles * kvh, span, block_n, T * H * (D + 2) * 4)
    split_size = triton.cdiv(triton.cdiv(span, num_splits), block_n) * block_n
    split = num_splits > 1
    part_acc = torch.empty((num_splits, T, H, D) if split else (1, 1, 1, 1),
                           dtype=torch.float32, device=q.device)
    part_ml = torch.empty((num_splits, T, H, 2) if split else (1, 1, 1, 2),
                          dtype=torch.float32, device=q.device)
    K.paged_attn_kernel[(tiles, kvh, num_splits)](
        q, k_cache, v_cache, out, part_acc, part_ml,
        attn.positions, attn.query_start_loc, attn.seq_lens, attn.block_tables,
        scale * math.log2(math.e), attn.num_seqs, split_size,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        attn.block_tables.stride(0), out.stride(0), out.stride(1),
        *part_acc.stride()[:3], *part_ml.stride()[:3],
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_D=D,
        BLOCK_D=triton.next_power_of_2(D), KV_BLOCK=kv_block, SPLIT=split,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST=q.is_cpu, DECODE=decode,  # CPU tensors: only the interpreter runs there
        WINDOW=window or 0)
    if split:
        K.split_reduce_kernel[(T, H)](
            part_acc, part_ml, out, num_splits, *part_acc.stride()[:3], *part_ml.stride()[:3],
            out.stride(0), out.stride(1), HEAD_D=D, BLOCK_D=triton.next_power_of_2(D),
            BLOCK_S=max(2, triton.next_power_of_2(num_splits)))
    return out
