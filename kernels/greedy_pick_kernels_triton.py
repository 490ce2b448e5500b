"""Triton programs of the greedy pick (host wrapper: kernels/greedy_pick_triton.py): each
row's argmax and logit[argmax] - logsumexp(row) in float32, reading the logits once.

Two steps, no atomics (deterministic): `chunk_stats_kernel` reduces a chunk of a row to
(max, first index of the max, sum of exp(x - max)); `combine_kernel` folds a row's chunks
in index order, so the first chunk holding the row's max gives the first index among
equal maxima, as torch.argmax picks."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def chunk_stats_kernel(logits_ptr, max_ptr, idx_ptr, sum_ptr, V, stride_row,
                       CHUNK: tl.constexpr, NUM_CHUNKS: tl.constexpr):
    """Grid (NUM_CHUNKS, rows): the stats of logits[row, chunk * CHUNK:][:CHUNK] at
    [row, chunk] of the [rows, NUM_CHUNKS] buffers (the index is the row's)."""
    chunk = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(logits_ptr + row * stride_row + offs, mask=offs < V,
                other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    # the first index of the max, spelled out (tl.argmax's tie rule is the backend's)
    i = tl.min(tl.where(x == m, offs, V), 0)
    s = tl.sum(tl.exp(x - m), 0)   # -inf entries add 0; nan when all are -inf (dropped)
    at = row * NUM_CHUNKS + chunk
    tl.store(max_ptr + at, m)
    tl.store(idx_ptr + at, i)
    tl.store(sum_ptr + at, s)


@triton.jit(do_not_specialize=["B"])
def combine_kernel(max_ptr, idx_ptr, sum_ptr, out_ptr, B, NUM_CHUNKS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Grid (rows,): out[0, row] = the row's argmax, out[1, row] = its raw logprob
    (out: [2, B] float64). B is not specialised on: one compiled variant for any B."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < NUM_CHUNKS
    at = row.to(tl.int64) * NUM_CHUNKS + offs
    m = tl.load(max_ptr + at, mask=mask, other=float("-inf"))
    s = tl.load(sum_ptr + at, mask=mask, other=0.0)
    idx = tl.load(idx_ptr + at, mask=mask, other=0)
    best = tl.max(m, 0)
    # chunks hold increasing indices: the least index among the chunks at the max
    tok = tl.min(tl.where(m == best, idx, 2147483647), 0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - best), 0.0), 0)
    # torch's log_softmax at the argmax: (x - max) - log(sum); nan for a row of -inf
    lp = (best - best) - tl.log(total)
    tl.store(out_ptr + row, tok.to(tl.float64))
    tl.store(out_ptr + B + row, lp.to(tl.float64))
