"""Triton programs for paged attention (host wrappers: kernels/attention_triton.py).

One program owns a *tile*: up to BLOCK_Q consecutive new tokens of one sequence times the
GROUP query heads that share one KV head, packed as BLOCK_M = BLOCK_Q * GROUP_PAD rows so
that K/V read from the cache serve every query head of the group (GQA):

    row r  ->  token  q_start + j * BLOCK_Q + r // GROUP_PAD,  head  kvh * GROUP + r % GROUP_PAD

Tiles of sequence b are numbered from `query_start_loc[b] // BLOCK_Q + b` on: that start is
increasing and leaves room for every tile of b, so the grid can be sized from static
counts (T // BLOCK_Q + num_seqs) and each program finds its sequence by binary search.

In a decode-only batch (DECODE: one new token per sequence, so token t is sequence t)
tile b is sequence b: no search, and the grid is one tile per sequence.

Axis 2 splits the key range (split-KV, for decodes over long contexts): each split writes
its unnormalised partial (acc, running max, running sum) and a reduce program merges them.

Sliding window (WINDOW > 0, a compile-time constant; 0 compiles the plain causal kernel):
a token at position p sees keys in (p - WINDOW, p], as transformers' Mistral mask does.
A tile's key range starts at its first token's window, rounded down to a cache block,
so keys wholly before every row's window are never read; the splits cover that range:

    keys   0 ....... lo | first - WINDOW + 1 ....... first ... last | (past last: unread)
                    ^ kv_start = (first - WINDOW + 1) rounded down to a KV_BLOCK multiple
"""
from __future__ import annotations

import triton
import triton.language as tl

from loramux_kernels.dot_triton import dot_f32



# finite "minus infinity" for the running max: keeps exp2(m_old - m_new) finite
_NEG = tl.constexpr(-1.0e30)


@triton.jit
def _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """Last sequence b whose first tile index (qsl[b] // BLOCK_Q + b) is <= tile."""
    lo = num_seqs * 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= tile, mid, lo)
        hi = tl.where(first <= tile, hi, mid - 1)
    return lo


# the step's sequence count only bounds a search: no variant per value class
@triton.jit(do_not_specialize=["num_seqs"])
def paged_attn_kernel(q_ptr, kc_ptr, vc_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
                      pos_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, qk_scale, num_seqs, split_size,
                      stride_qt, stride_qh, stride_kb, stride_ko, stride_kh,
                      stride_vb, stride_vo, stride_vh, stride_bt, stride_ot, stride_oh,
                      stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_N: tl.constexpr, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                      KV_BLOCK: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                      UPCAST: tl.constexpr, DECODE: tl.constexpr = False,
                      WINDOW: tl.constexpr = 0):
    """Grid (tiles, KV heads, splits). qk_scale already includes log2(e). With WINDOW,
    split_size splits the window's key range, not the whole context."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:  # the serial chain of the search's dependent loads is most of a short decode
        b = tile
        q_start = tile
        q_len = 1
        j = 0
    else:
        b = _find_seq(qsl_ptr, num_seqs, tile, BLOCK_Q)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        j = tile - (q_start // BLOCK_Q + b)
        if j * BLOCK_Q >= q_len:
            return
    rows = tl.arange(0, BLOCK_M)
    qi = j * BLOCK_Q + rows // GROUP_PAD
    hg = rows % GROUP_PAD
    row_mask = (qi < q_len) & (hg < GROUP)
    tok = (q_start + qi).to(tl.int64)
    head = kvh * GROUP + hg
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_D
    pos = tl.load(pos_ptr + tok, mask=row_mask, other=-1)
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    # keys this tile can see: up to the last token's position (positions grow within a seq)
    last = q_start + tl.minimum(q_len, (j + 1) * BLOCK_Q) - 1
    kv_end = tl.minimum(tl.load(seq_lens_ptr + b), tl.load(pos_ptr + last) + 1)
    kv_lo = split * split_size
    if WINDOW > 0:   # skip the keys before the window of the tile's first token
        first = tl.load(pos_ptr + q_start + j * BLOCK_Q)
        kv_lo += tl.maximum(first - (WINDOW - 1), 0) // KV_BLOCK * KV_BLOCK
    kv_hi = tl.minimum(kv_end, kv_lo + split_size)
    m_i = tl.full([BLOCK_M], _NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for start in range(kv_lo, kv_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_mask = kpos < kv_hi
        blk = tl.load(bt_row + kpos // KV_BLOCK, mask=k_mask, other=0).to(tl.int64)
        off = kpos % KV_BLOCK
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ko
                    + kvh * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vc_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vo
                    + kvh * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0)
        s = dot_f32(q.to(k.dtype), tl.trans(k), PRECISION, UPCAST) * qk_scale
        allowed = k_mask[None, :] & (kpos[None, :] <= pos[:, None])
        if WINDOW > 0:
            allowed = allowed & (kpos[None, :] > pos[:, None] - WINDOW)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, PRECISION, UPCAST)
        m_i = m_new
    if SPLIT:
        pa = part_acc_ptr + split * stride_ps + tok[:, None] * stride_pt \
            + head[:, None] * stride_ph + offs_d[None, :]
        tl.store(pa, acc, mask=row_mask[:, None] & d_mask[None, :])
        pm = part_ml_ptr + split * stride_ms + tok * stride_mt + head * stride_mh
        tl.store(pm, m_i, mask=row_mask)
        tl.store(pm + 1, l_i, mask=row_mask)
    else:
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # rows outside the tile have l = 0
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


@triton.jit
def split_reduce_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_splits,
                        stride_ps, stride_pt, stride_ph, stride_ms, stride_mt, stride_mh,
                        stride_ot, stride_oh, HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_S: tl.constexpr):
    """Grid (tokens, heads): merge the split partials of one (token, head)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    pm = part_ml_ptr + offs_s * stride_ms + t * stride_mt + h * stride_mh
    m = tl.load(pm, mask=s_mask, other=_NEG)
    l_ = tl.load(pm + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + offs_s[:, None] * stride_ps + t * stride_pt + h * stride_ph
                  + offs_d[None, :], mask=s_mask[:, None] & (offs_d < HEAD_D)[None, :], other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l_ * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_D)


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, KV_BLOCK: tl.constexpr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_kb, stride_ko, stride_kch, stride_vb, stride_vo, stride_vch,
                    NUM_KV: tl.constexpr, HEAD_D: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (tokens,): copy token t's K/V heads into its cache slot (slot < 0: skip)."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // KV_BLOCK
    off = slot % KV_BLOCK
    hh = tl.arange(0, BLOCK_H)[:, None]
    dd = tl.arange(0, BLOCK_D)[None, :]
    mask = (hh < NUM_KV) & (dd < HEAD_D)
    k = tl.load(k_ptr + t * stride_kt + hh * stride_kh + dd, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + hh * stride_vh + dd, mask=mask)
    tl.store(kc_ptr + blk * stride_kb + off * stride_ko + hh * stride_kch + dd,
             k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + blk * stride_vb + off * stride_vo + hh * stride_vch + dd,
             v.to(vc_ptr.dtype.element_ty), mask=mask)
