"""A worker's mirror of the requests rank 0 schedules, rebuilt from step plans.

It turns each StepPlan back into the SchedulerOutput rank 0's runner saw (same tokens,
positions, block tables, slots and sampling rows), so every rank's runner builds
identical inputs. Mirror requests are plain Requests holding token ids only; workers
never sample. With async scheduling a row may run one token past those known (the token
rank 0's step in flight is picking); it reaches the mirror in a later plan.

A forgotten handle only leaves the mirror: a step already launched holds its Request in
the SchedulerOutput built for it, and rank 0 forgets only finished requests, which it
never schedules again."""
from __future__ import annotations

from engine.distributed.plan import StepPlan
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from loramux_core.sampling import SamplingParams

_PARAMS = SamplingParams()


class RequestMirror:
    def __init__(self):
        self._reqs: dict[int, Request] = {}
        self._blocks: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        for h in plan.forget:
            del self._reqs[h]
            del self._blocks[h]
        out = SchedulerOutput()
        for s in plan.seqs:
            req = self._reqs.get(s.handle)
            if req is None:
                req = self._reqs[s.handle] = Request(f"rank0-{s.handle}", list(s.new_tokens),
                                                     _PARAMS)
                self._blocks[s.handle] = []
            else:
                for t in s.new_tokens:
                    req.append_token(t)
            blocks = self._blocks[s.handle]
            if s.reset_blocks:
                blocks.clear()
            blocks.extend(s.new_blocks)
            # one more than known: the token in flight (async scheduling; a placeholder)
            assert s.start + s.num_new <= req.num_tokens + 1, (s.handle, s.start, s.num_new)
            out.scheduled.append(ScheduledRequest(req, s.start, s.num_new, tuple(blocks),
                                                  s.slot, s.samples))
        return out
