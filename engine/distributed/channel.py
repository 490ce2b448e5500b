"""Rank 0 -> workers messages over the control group: a 3-value header, then the payload.

Both are int64 CPU tensors sent with gloo broadcast; nothing is pickled. The header's
sequence number lets a worker check it missed nothing."""
from __future__ import annotations

import torch


class PlanChannel:
    def __init__(self, control, rank: int):
        self._pg = control
        self._rank = rank
        self._seq = 0

    def send(self, op: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0 only."""
        assert self._rank == 0
        n = 0 if payload is None else payload.numel()
        self._seq += 1
        self._bcast(torch.tensor([op, n, self._seq], dtype=torch.int64))
        if n:
            self._bcast(payload.to(torch.int64).contiguous())

    def recv(self) -> tuple[int, torch.Tensor | None]:
        """Workers: the next (op, payload)."""
        header = torch.empty(3, dtype=torch.int64)
        self._bcast(header)
        op, n, seq = header.tolist()
        self._seq += 1
        assert seq == self._seq, f"plan {seq} arrived, expected {self._seq}"
        if not n:
            return op, None
        payload = torch.empty(n, dtype=torch.int64)
        self._bcast(payload)
        return op, payload

    def _bcast(self, t: torch.Tensor) -> None:
        self._pg.broadcast(t, 0).wait()
