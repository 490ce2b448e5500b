"""Rank 0 -> workers messages over the control group, one gloo broadcast each when small.

A message is int64 values: the header (op, payload length, sequence number), then the
payload. Every message starts with one broadcast of a fixed FIRST values: the header and
as much payload as fits (a decode step's plan is about 8 values per sequence, ~520 at
batch 64); only a longer payload sends its remainder in a second broadcast, whose length
the header told the workers. One broadcast instead of two per step: a step's plan reaches
the worker in about half the time (benchmarks/results/RETIRED.md). Nothing is
pickled. The sequence number lets a worker check it missed nothing.
"""
from __future__ import annotations

import torch

FIRST = 4096          # values in a message's first broadcast (32 KiB)
_HEADER = 3


class PlanChannel:
    def __init__(self, control, rank: int):
        self._pg = control
        self._rank = rank
        self._seq = 0
        # reused: each broadcast completes (wait) before the next message touches it;
        # written and read through a numpy view of the same memory (a torch slice
        # assignment costs ~10 us, on the path from rank 0's schedule to every replay)
        self._first = torch.zeros(FIRST, dtype=torch.int64)
        self._view = self._first.numpy()

    def send(self, op: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0 only."""
        assert self._rank == 0
        n = 0 if payload is None else payload.numel()
        self._seq += 1
        k = min(n, FIRST - _HEADER)
        view = self._view
        view[:_HEADER] = (op, n, self._seq)
        if k:
            view[_HEADER:_HEADER + k] = payload[:k].numpy()
        self._bcast(self._first)
        if n > k:
            self._bcast(payload[k:].to(torch.int64).contiguous())

    def recv(self) -> tuple[int, torch.Tensor | None]:
        """Workers: the next (op, payload)."""
        self._bcast(self._first)
        view = self._view
        op, n, seq = view[:_HEADER].tolist()
        self._seq += 1
        assert seq == self._seq, f"plan {seq} arrived, expected {self._seq}"
        if not n:
            return op, None
        k = min(n, FIRST - _HEADER)
        # a copy: the buffer is reused by the next message
        head = torch.from_numpy(view[_HEADER:_HEADER + k].copy())
        if n == k:
            return op, head
        rest = torch.empty(n - k, dtype=torch.int64)
        self._bcast(rest)
        return op, torch.cat([head, rest])

    def _bcast(self, t: torch.Tensor) -> None:
        self._pg.broadcast(t, 0).wait()
