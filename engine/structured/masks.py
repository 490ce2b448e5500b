"""The allowed-token bitmask of a step's constrained rows, filled on the host.

One bit per token id, 32 to an int32 word (llguidance's layout, token t at word t // 32,
bit t % 32), one row per constrained sampling row. llguidance fills every row at once on
its own threads with the GIL released, straight into one pinned buffer, so the copy to
the device does not block. One buffer serves every step: a step's fill comes after the
previous step's tokens were read (engine/engine.py), and those were sampled after that
step's mask copy landed, in stream order.
"""
from __future__ import annotations

import llguidance as llg
import torch

from loramux_engine.request import Request


class TokenMasks:
    def __init__(self, vocab_size: int, max_rows: int, pin: bool, threads: int | None = None):
        """`vocab_size`: token ids the mask covers (ids past it are never allowed);
        `max_rows`: the most sampling rows of a step; `pin`: page-locked (CUDA)."""
        self.words = (vocab_size + 31) // 32
        self._bitmask = torch.zeros((max_rows, self.words), dtype=torch.int32, pin_memory=pin)
        self._executor = llg.LLExecutor(threads)

    def fill(self, requests: list[Request]) -> tuple[list[int], torch.Tensor] | None:
        """(rows, bitmask [len(rows), words]) for the constrained rows among a step's
        sampling `requests` (in row order), or None if none is. A request that finished
        since the step was scheduled (its token will be discarded) is left free."""
        rows = [i for i, r in enumerate(requests)
                if r.grammar is not None and r.grammar.ready and not r.is_finished]
        if not rows:
            return None
        out = self._bitmask[:len(rows)]
        matchers = [(requests[i].grammar.matcher, k) for k, i in enumerate(rows)]
        self._executor.unsafe_compute_mask_ptr(matchers, out.data_ptr(), self.words * 4,
                                               len(rows))
        return rows, out
