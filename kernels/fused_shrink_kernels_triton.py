"""What the fused-shrink programs (norm_shrink_kernels_triton.py,
silu_shrink_kernels_triton.py) share: where a split-K shrink program stands (its row
block or row, its K chunk) and an adapter's real rank (`rank_of`, also used by the LoRA
token and mixed programs). Inlined where called."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_program(slots_ptr, q, T, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program q = (row block, K chunk): the chunk index, the block's token indices
    (int64), which of them are inside T, and their slots (-1 past T)."""
    mb = q // SPLIT_K
    tok = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = tok < T
    slots = tl.load(slots_ptr + tok, mask=in_t, other=-1).to(tl.int32)
    return q % SPLIT_K, tok.to(tl.int64), in_t, slots


@triton.jit
def row_program(slots_ptr, q, SPLIT_K: tl.constexpr):
    """Program q = (row, K chunk) of a mixed batch: the chunk index, the row (int64) and
    its slot (-1: no adapter)."""
    t = (q // SPLIT_K).to(tl.int64)
    return q % SPLIT_K, t, tl.load(slots_ptr + t).to(tl.int32)


@triton.jit
def k_bounds(ks, k_chunk, K):
    """Columns [k_lo, k_hi) of K chunk ks (the last chunk may be short)."""
    k_lo = ks * k_chunk
    return k_lo, tl.minimum(K, k_lo + k_chunk)


@triton.jit
def rank_of(ranks_ptr, slot, R, HAS_RANKS: tl.constexpr):
    """The real rank of adapter `slot` (>= 0): its entry in ranks, or the pool's R for
    all when there is no ranks tensor."""
    if HAS_RANKS:
        return tl.load(ranks_ptr + slot)
    return R
