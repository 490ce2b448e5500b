"""The tensor-parallel group one engine rank belongs to.

Every model layer takes a TPGroup and shards its weights by (rank, size); the two
collectives the Megatron layout needs (and the broadcast of rank 0's sampled tokens,
engine/runner.py) are here so that every communication in the model
is a visible call. At size 1 both are no-ops, so the single-device path pays nothing.
`TPGroup.without_peers()` makes them no-ops on this rank for a while: a dry run whose
outputs nobody reads (the parallel compile's listing of the variants a warm-up launches,
engine/precompile.py) runs on rank 0 alone, its shard's shapes being every rank's.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


class _Peers:
    """Whether a group's collectives reach the other ranks now: shared by every copy of
    one TPGroup (dataclasses.replace keeps it), so every layer built with it follows."""

    def __init__(self):
        self.skipped = 0   # > 0: inside TPGroup.without_peers()


@dataclass(frozen=True)
class TPGroup:
    """Rank `rank` of a tensor-parallel group of `size` ranks.

    `group` is the torch.distributed process group (None = the default group); it is
    unused at size 1. `reducer`, when set, sums the tensors it `fits` instead of the
    group (the one-shot all-reduce of engine/distributed/fast_allreduce.py)."""
    rank: int = 0
    size: int = 1
    group: Any = None
    reducer: Any = None
    peers: _Peers = field(default_factory=_Peers, compare=False, repr=False)

    def __post_init__(self):
        assert self.size >= 1 and 0 <= self.rank < self.size, (self.rank, self.size)

    @classmethod
    def single(cls) -> "TPGroup":
        """The trivial group of one rank (no communication)."""
        return cls(0, 1, None)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @contextmanager
    def without_peers(self) -> Iterator[None]:
        """While entered, this group (every layer built with it) skips the other ranks:
        all_reduce and broadcast leave `t` as it is, all_gather repeats it (the same
        shapes, no values worth reading). Only for work whose results are thrown away,
        while no other rank waits on this one."""
        self.peers.skipped += 1
        try:
            yield
        finally:
            self.peers.skipped -= 1

    @property
    def _talks(self) -> bool:
        return self.size > 1 and not self.peers.skipped

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place; returns `t`."""
        if self._talks:
            if self.reducer is not None and self.reducer.fits(t):
                return self.reducer.all_reduce(t)
            torch.distributed.all_reduce(t, group=self.group)
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's `t` into every rank's `t` (same shape and dtype everywhere), in place."""
        if self._talks:
            if self.group is None:   # the default group (NCCL)
                torch.distributed.broadcast(t, 0)
            else:   # a free-standing group (gloo on the CPU): no global rank to translate
                self.group.broadcast(t, 0).wait()
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` (same shape on all ranks) along `dim`, in rank order."""
        if self.size == 1:
            return t
        if self.peers.skipped:
            return torch.cat([t] * self.size, dim=dim)
        parts = [torch.empty_like(t) for _ in range(self.size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)
