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

from loramux_engine.distributed.plan import StepPlan
from loramux_engine.request import Request
from loramux_engine.scheduler import ScheduledRequest, SchedulerOutput
from loramux_core.sampling import SamplingParams

_PARAMS = SamplingParams()


class RequestMirror:
    def __init__(self):
        self._reqs: dict[int, Request] = {}
        # each request's block table, one tuple until it changes (as the scheduler hands
        # it on rank 0), so the graph input fill skips rows whose table is unchanged
        self._blocks: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def apply(self, plan: StepPlan) -> SchedulerOutput:
        for h in plan.forget:
            del self._reqs[h]
            del self._blocks[h]
        out = SchedulerOutput()
        scheduled = out.scheduled
        reqs, tables = self._reqs, self._blocks
        for handle, start, num_new, slot, samples, tokens, reset, new_blocks in plan.seqs:
            req = reqs.get(handle)
            if req is None:
                req = reqs[handle] = Request(f"rank0-{handle}", list(tokens), _PARAMS)
                blocks = tables[handle] = new_blocks
            else:
                for t in tokens:
                    req.append_token(t)
                blocks = tables[handle]
                if reset:
                    blocks = tables[handle] = new_blocks
                elif new_blocks:
                    blocks = tables[handle] = blocks + new_blocks
            # one more than known: the token in flight (async scheduling; a placeholder)
            assert start + num_new <= req.num_tokens + 1, (handle, start, num_new)
            scheduled.append(ScheduledRequest(req, start, num_new, blocks, slot, samples))
        return out
