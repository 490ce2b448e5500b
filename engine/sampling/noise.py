"""Counter-based Gumbel noise: the noise of a token depends only on a row's key and the
token's id, so a whole batch draws in a few tensor operations, with no generator state.

A row's key is mix_seed(seed, sample_index, step) (state.py): a request's noise at step
t is the same whatever else is in the batch, wherever it sits, on every run and on every
replica, so a request resumed elsewhere at step t draws what the first would have.
Each (key, token id) pair goes through the splitmix64 finalizer, done in int64 tensors:
multiplication wraps like the unsigned arithmetic, and the shifts are made logical by a
mask. No host sync, no per-row launch, nothing the shape of the batch does not fix.
"""
from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_UNIFORM_BITS = 23  # (k + 0.5) / 2**23 are exact in float32 and never round to 1


def _signed(x: int) -> int:
    """A 64-bit unsigned constant as the int64 with the same bits."""
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _finalize(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shr(x, 30)) * _signed(_MUL1)
    x = (x ^ _shr(x, 27)) * _signed(_MUL2)
    return x ^ _shr(x, 31)


def gumbel_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(keys), vocab] in float32: row i, column v from (keys[i], v)
    alone."""
    rows = torch.tensor([_signed(k) for k in keys], dtype=torch.int64, device=device)
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN)
    bits = _shr(_finalize(rows[:, None] + cols[None, :]), 64 - _UNIFORM_BITS)
    uniform = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << _UNIFORM_BITS))
    # -log(-log(U)) with U in (0, 1): never 0 or 1, so never an infinity
    return uniform.log_().neg_().log_().neg_()
