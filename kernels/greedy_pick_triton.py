"""Host wrapper of the greedy pick (kernels/greedy_pick_kernels_triton.py; CUDA, or the
interpreter): the logits are read once, in chunks of CHUNK values, so a batch of 64 rows
of a 128K vocabulary gives ~2000 programs. Grids and compiled variants come from the
vocabulary size and dtype only (never the rows), so one variant serves every CUDA-graph
bucket and the launches are capturable."""
from __future__ import annotations

import torch
import triton

from loramux_kernels import greedy_pick_kernels_triton as K

CHUNK = 4096          # vocabulary values per program


def greedy_pick(logits: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """logits [B, V] (bf16, fp16 or fp32, rows contiguous) -> [2, B] float64: each row's
    argmax (the first of equal maxima) and logit[argmax] - logsumexp(row) in float32,
    as kernels/greedy_pick_ref.py computes them."""
    assert logits.dim() == 2 and logits.stride(-1) == 1, (logits.shape, logits.stride())
    assert chunk > 0 and chunk & (chunk - 1) == 0, chunk
    B, V = logits.shape
    chunk = min(chunk, triton.next_power_of_2(V))
    n = triton.cdiv(V, chunk)
    out = torch.empty((2, B), dtype=torch.float64, device=logits.device)
    if B == 0:
        return out
    maxes = torch.empty((B, n), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxes)
    idx = torch.empty((B, n), dtype=torch.int32, device=logits.device)
    K.chunk_stats_kernel[(n, B)](logits, maxes, idx, sums, V, logits.stride(0),
                                 CHUNK=chunk, NUM_CHUNKS=n)
    K.combine_kernel[(B,)](maxes, idx, sums, out, B, NUM_CHUNKS=n,
                           BLOCK=triton.next_power_of_2(n))
    return out
