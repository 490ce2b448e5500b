"""A random LoRA slot pool for the kernel tests, laid out as the engine's pool is."""
from __future__ import annotations

import torch


def slot_pool(S: int, offsets, ranks, k_in: int, dtype, device, R: int, seed: int):
    """(a [L, S, R, k_in], b [L, N, R], ranks [L] int32) with random A and B (never zero
    B); each slot's weights past its rank are zero, as the loader leaves them."""
    g = torch.Generator().manual_seed(seed)
    L = len(ranks)
    a = torch.randn(L, S, R, k_in, generator=g) / k_in ** 0.5
    b = torch.randn(L, offsets[-1], R, generator=g) / R ** 0.5
    for slot, r in enumerate(ranks):
        a[slot, :, r:] = 0
        b[slot, :, r:] = 0
    return (a.to(device, dtype), b.to(device, dtype),
            torch.tensor(ranks, dtype=torch.int32, device=device))
