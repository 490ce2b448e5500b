"""One-launch LoRA for decode batches whose rows (mostly) share one adapter: shrink and
expand of a layer group in a single Triton program grid (host wrapper:
kernels/lora_uniform_triton.py).

A decode step is latency-bound (one adapter's A/B of a group is ~0.3 MB). Here one 1-D
grid does shrink and expand, in two roles (on an H100 this was slower than the two token
kernels back to back: the handoff below costs more than a kernel boundary; not the
default, see kernels/lora_triton.py UNIFORM_ONE_LAUNCH):

- programs [0, n_shrink): (row block, slice, K chunk): split-K partial sums
  hp[ks, s, tok, :] = x[tok, K chunk] @ A[slot, s, :, K chunk].T (float32, plain stores);
- programs [n_shrink, n_shrink + n_expand): output tiles (row block, slice, BLOCK_N
  columns). Each loads its first y tile and its B tile, then waits until every shrink
  program has signalled (a counter in `sync`), sums the partials of its rows and writes
  y += h @ B.T.

The wait needs every shrink program to make progress while expand programs spin: shrink
programs have the lower program ids (CUDA starts blocks of a 1-D grid in id order, the
property stream-K kernels rely on too) and the host keeps the grid within what the GPU
holds at once, so either alone rules out a deadlock. The last expand program resets the
counters to zero for the next launch (`sync` is one int32 [2] per device, zeroed once).
Under the interpreter programs run one after another in id order, so the wait returns at
once.

Rows: a row block holds BLOCK_M consecutive tokens in batch order (no sorting, no
per-step metadata: the slots are read from token_slots). It is done one adapter at a time
(the largest slot among its rows not done yet, until only rows without an adapter are
left), so a block of one adapter is one matrix product and any mapping stays correct.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.lora_kernels_triton import _shrink_tile, _slice_bounds


@triton.jit
def _rank_of(ranks_ptr, slot, R, HAS_RANKS: tl.constexpr):
    if HAS_RANKS:
        return tl.load(ranks_ptr + tl.maximum(slot, 0))
    return R


@triton.jit
def _row_block(slots_ptr, mb, T, BLOCK_M: tl.constexpr):
    """Row block mb: its token indices, which are inside T, and their slots (-1 past T)."""
    tok = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    in_t = tok < T
    slots = tl.load(slots_ptr + tok, mask=in_t, other=-1).to(tl.int32)
    return tok.to(tl.int64), in_t, slots


@triton.jit
def _load_b(b_ptr, slot, rank, offs_n, n_mask, stride_bl, stride_bn, stride_br,
            BLOCK_R: tl.constexpr):
    """B[slot, offs_n, :rank] as a [BLOCK_R, BLOCK_N] tile (zero where slot < 0)."""
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < tl.where(slot >= 0, rank, 0)
    return tl.load(b_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_bl
                   + offs_n[None, :] * stride_bn + offs_r[:, None] * stride_br,
                   mask=r_mask[:, None] & n_mask[None, :], other=0.0)


@triton.jit
def _load_h(hp_ptr, s, tok, run, rank, stride_hk, stride_hs, stride_ht, stride_hr,
            SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """h [BLOCK_M, BLOCK_R] of the rows in `run`: the SPLIT_K partials summed (read
    through L2: other programs wrote them during this launch), all loads unrolled so that
    they are in flight together."""
    offs_r = tl.arange(0, BLOCK_R)
    ptrs = hp_ptr + s * stride_hs + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr
    mask = run[:, None] & (offs_r < rank)[None, :]
    h = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for ks in tl.static_range(SPLIT_K):
        h += tl.load(ptrs + ks * stride_hk, mask=mask, other=0.0, cache_modifier=".cg")
    return h


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """acc + a @ b, float32, accumulated in the product's own registers (no second tile).
    UPCAST: as kernels.dot_triton.dot_f32 (the interpreter's bfloat16)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _signal(count_ptr):
    """This program's stores are done: count it (release, after the whole block)."""
    tl.debug_barrier()
    tl.atomic_add(count_ptr, 1, sem="release")


@triton.jit
def _wait(count_ptr, target):
    """Spin until *count_ptr reaches target, then acquire what its signallers wrote."""
    seen = tl.load(count_ptr, volatile=True)
    while seen < target:
        seen = tl.load(count_ptr, volatile=True)
    tl.atomic_add(count_ptr, 0, sem="acquire")
    tl.debug_barrier()


@triton.jit
def _shrink_program(x_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, pid, T, K, R, S, k_chunk,
                    stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                    stride_hk, stride_hs, stride_ht, stride_hr,
                    HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr):
    """Shrink program pid = (row block, slice, K chunk): its split-K partials in hp."""
    mb = pid // (S * SPLIT_K)
    s = (pid // SPLIT_K) % S
    ks = pid % SPLIT_K
    tok, in_t, left = _row_block(slots_ptr, mb, T, BLOCK_M)
    k_lo = ks * k_chunk
    k_hi = tl.minimum(K, k_lo + k_chunk)
    offs_r = tl.arange(0, BLOCK_R)
    h_base = hp_ptr + ks * stride_hk + s * stride_hs
    slot = tl.max(left, axis=0)
    while slot >= 0:           # one pass per adapter in the block (one when uniform)
        run = left == slot
        acc = _shrink_tile(x_ptr, a_ptr, tok, run, slot, s,
                           _rank_of(ranks_ptr, slot, R, HAS_RANKS), k_lo, k_hi,
                           stride_xt, stride_xk, stride_al, stride_as, stride_ar,
                           stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
        tl.store(h_base + tok[:, None] * stride_ht + offs_r[None, :] * stride_hr, acc,
                 mask=run[:, None] & (offs_r < R)[None, :])
        left = tl.where(run, -1, left)
        slot = tl.max(left, axis=0)


@triton.jit
def _expand_program(b_ptr, y_ptr, hp_ptr, sync_ptr, slots_ptr, ranks_ptr, e, T, R,
                    n_shrink, n_expand, tiles_per_block, o0, o1, o2, o3, o4, c1, c2, c3,
                    stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                    stride_hk, stride_hs, stride_ht, stride_hr,
                    HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
                    UPCAST: tl.constexpr, WAIT: tl.constexpr):
    """Expand program e: tiles e, e + n_expand, ... of the (row block, tile) list; WAIT:
    for the n_shrink shrink programs of this launch, after loading its first y and B."""
    for i in range(0, tl.cdiv(tl.cdiv(T, BLOCK_M) * tiles_per_block - e, n_expand)):
        u = e + i * n_expand
        mb = u // tiles_per_block
        t = u % tiles_per_block
        s = (t >= c1).to(tl.int32) + (t >= c2).to(tl.int32) + (t >= c3).to(tl.int32)
        lo, hi = _slice_bounds(s, o0, o1, o2, o3, o4)
        first = tl.where(s == 0, 0, tl.where(s == 1, c1, tl.where(s == 2, c2, c3)))
        offs_n = lo + (t - first) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        tok, in_t, left = _row_block(slots_ptr, mb, T, BLOCK_M)
        y_ptrs = y_ptr + tok[:, None] * stride_yt + offs_n[None, :] * stride_yn
        y_mask = in_t[:, None] & n_mask[None, :]
        y = tl.load(y_ptrs, mask=y_mask, other=0.0)
        slot = tl.max(left, axis=0)
        rank = _rank_of(ranks_ptr, slot, R, HAS_RANKS)
        bt = _load_b(b_ptr, slot, rank, offs_n, n_mask, stride_bl, stride_bn, stride_br,
                     BLOCK_R)
        if WAIT:
            if i == 0:         # y and B of the first tile are on their way meanwhile
                _wait(sync_ptr, n_shrink)
        acc = y.to(tl.float32)
        while slot >= 0:
            run = left == slot
            h = _load_h(hp_ptr, s, tok, run, rank, stride_hk, stride_hs, stride_ht,
                        stride_hr, SPLIT_K, BLOCK_M, BLOCK_R)
            acc = _dot_acc(h.to(bt.dtype), bt, acc, PRECISION, UPCAST)
            left = tl.where(run, -1, left)
            slot = tl.max(left, axis=0)
            if slot >= 0:       # the next adapter (blocks of several only)
                rank = _rank_of(ranks_ptr, slot, R, HAS_RANKS)
                bt = _load_b(b_ptr, slot, rank, offs_n, n_mask, stride_bl, stride_bn,
                             stride_br, BLOCK_R)
        tl.store(y_ptrs, acc.to(y.dtype), mask=y_mask)


# T (the step's tokens) only bounds rows: no variant per value class (1, a
# multiple of 16, other), which would triple the compiles of every shape
@triton.jit(do_not_specialize=["T"])
def lora_uniform_kernel(x_ptr, a_ptr, b_ptr, y_ptr, hp_ptr, sync_ptr, slots_ptr,
                        ranks_ptr, T, K, R, S, k_chunk,
                        n_shrink, n_expand, tiles_per_block,
                        o0, o1, o2, o3, o4, c1, c2, c3,
                        stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                        stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                        stride_hk, stride_hs, stride_ht, stride_hr,
                        HAS_RANKS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                        PRECISION: tl.constexpr, UPCAST: tl.constexpr, ROLE: tl.constexpr):
    """ROLE 0, grid (n_shrink + n_expand,): y[tok, slice s] += x[tok] @ A[slot, s].T @
    B[slot, s].T in one launch. ROLE 1, grid (n_shrink,): the shrink alone (hp); ROLE 2,
    grid (n_expand,): the expand alone from a finished hp (no counters either way).

    c1..c3: BLOCK_N tiles before slices 1..3 (tiles_per_block = all slices' tiles); the
    expand program e takes tiles e, e + n_expand, ... of the (row block, tile) list."""
    pid = tl.program_id(0)
    if ROLE == 1:
        _shrink_program(x_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, pid, T, K, R, S, k_chunk,
                        stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                        stride_hk, stride_hs, stride_ht, stride_hr, HAS_RANKS, SPLIT_K,
                        BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
    elif ROLE == 2:
        _expand_program(b_ptr, y_ptr, hp_ptr, sync_ptr, slots_ptr, ranks_ptr, pid, T, R,
                        n_shrink, n_expand, tiles_per_block, o0, o1, o2, o3, o4, c1, c2, c3,
                        stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                        stride_hk, stride_hs, stride_ht, stride_hr, HAS_RANKS, SPLIT_K,
                        BLOCK_M, BLOCK_R, BLOCK_N, PRECISION, UPCAST, False)
    elif pid < n_shrink:
        _shrink_program(x_ptr, a_ptr, hp_ptr, slots_ptr, ranks_ptr, pid, T, K, R, S, k_chunk,
                        stride_xt, stride_xk, stride_al, stride_as, stride_ar, stride_ak,
                        stride_hk, stride_hs, stride_ht, stride_hr, HAS_RANKS, SPLIT_K,
                        BLOCK_M, BLOCK_R, BLOCK_K, PRECISION, UPCAST)
        _signal(sync_ptr)
    else:
        _expand_program(b_ptr, y_ptr, hp_ptr, sync_ptr, slots_ptr, ranks_ptr, pid - n_shrink,
                        T, R, n_shrink, n_expand, tiles_per_block, o0, o1, o2, o3, o4,
                        c1, c2, c3, stride_bl, stride_bn, stride_br, stride_yt, stride_yn,
                        stride_hk, stride_hs, stride_ht, stride_hr, HAS_RANKS, SPLIT_K,
                        BLOCK_M, BLOCK_R, BLOCK_N, PRECISION, UPCAST, True)
        tl.debug_barrier()
        if tl.atomic_add(sync_ptr + 1, 1, sem="acq_rel") == n_expand - 1:
            tl.atomic_xchg(sync_ptr, 0)          # every program is past the counters:
            tl.atomic_xchg(sync_ptr + 1, 0)      # ready for the next launch
