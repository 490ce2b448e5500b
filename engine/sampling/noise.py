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


def _shift_xor(x: torch.Tensor, k: int, scratch: torch.Tensor) -> torch.Tensor:
    """x ^= x >> k (logical: torch's >> on int64 is arithmetic, so the sign is masked off),
    in place, through `scratch`."""
    torch.bitwise_right_shift(x, k, out=scratch)
    scratch &= (1 << (64 - k)) - 1
    return x.bitwise_xor_(scratch)


def gumbel_noise(keys: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """Gumbel(0, 1) noise [len(keys), vocab] in float32: row i, column v from (keys[i], v)
    alone. In place over two int64 tensors of the output's shape (the hash is bound by
    memory traffic)."""
    rows = torch.tensor([_signed(k) for k in keys], dtype=torch.int64, device=device)
    cols = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * _signed(_GOLDEN)
    x = rows[:, None] + cols[None, :]
    scratch = torch.empty_like(x)
    _shift_xor(x, 30, scratch).mul_(_signed(_MUL1))
    _shift_xor(x, 27, scratch).mul_(_signed(_MUL2))
    _shift_xor(x, 31, scratch)
    torch.bitwise_right_shift(x, 64 - _UNIFORM_BITS, out=scratch)
    scratch &= (1 << _UNIFORM_BITS) - 1
    uniform = scratch.to(torch.float32).add_(0.5).mul_(1.0 / (1 << _UNIFORM_BITS))
    # -log(-log(U)) with U in (0, 1): never 0 or 1, so never an infinity
    return uniform.log_().neg_().log_().neg_()
