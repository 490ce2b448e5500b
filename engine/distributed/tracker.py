"""Rank 0's record of what the workers' request mirror holds, to send only what changed.

For each request the workers know: its handle, how many of its tokens they have, and the
block table they hold. `plan` turns a SchedulerOutput into a StepPlan carrying the new
tokens and new block ids only, and the handles of requests that finished since."""
from __future__ import annotations

import itertools

from loramux_engine.distributed.plan import SeqPlan, StepPlan
from loramux_engine.request import Request
from loramux_engine.scheduler import SchedulerOutput


class _Known:
    __slots__ = ("handle", "num_tokens", "blocks")

    def __init__(self, handle: int):
        self.handle = handle
        self.num_tokens = 0
        self.blocks: tuple[int, ...] = ()


class PlanTracker:
    def __init__(self):
        self._known: dict[Request, _Known] = {}   # Request hashes by identity
        self._handles = itertools.count(1)

    def __len__(self) -> int:
        return len(self._known)

    def plan(self, out: SchedulerOutput, slot_ops: list[tuple[int, int, int]],
             greedy: bool = False) -> StepPlan:
        """`greedy`: rank 0's runner's decision for this step (ModelRunner.takes_greedy_pick)."""
        known = self._known
        finished = [r for r in known if r.is_finished]
        forget = tuple(known.pop(r).handle for r in finished)
        return StepPlan(forget, tuple(slot_ops), tuple(map(self._seq, out.scheduled)), greedy)

    def _seq(self, s) -> SeqPlan:
        req = s.request
        known = self._known.get(req)
        if known is None:
            known = self._known[req] = _Known(next(self._handles))
        tokens = req.all_token_ids
        new_tokens = tuple(tokens[known.num_tokens:])
        known.num_tokens = len(tokens)
        blocks, old = s.block_ids, known.blocks
        if blocks is old:   # the scheduler hands the same tuple until the table changes
            reset, new_blocks = False, ()
        else:
            blocks = tuple(blocks)
            reset = blocks[:len(old)] != old
            new_blocks = blocks if reset else blocks[len(old):]
            known.blocks = blocks
        return SeqPlan(known.handle, s.start, s.num_new_tokens, s.slot, s.samples,
                       new_tokens, reset, new_blocks)
