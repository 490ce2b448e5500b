"""The step-plan wire format and the rank-0 tracker / worker mirror pair, without processes:
a plan carries only what changed, and the mirror rebuilds exactly the SchedulerOutput
rank 0 ran (tokens, positions, block tables, slots, sampling rows), through decodes,
chunked prefill, block growth, preemption (table rebuilt) and finished requests."""
from __future__ import annotations

import torch

from loramux_engine.distributed.mirror import RequestMirror
from loramux_engine.distributed.plan import (HOST_DROP, RETIRE, SLOT_LOAD, SeqPlan, StepPlan,
                                     decode_add_adapter, decode_step, encode_add_adapter,
                                     encode_step)
from loramux_engine.distributed.tracker import PlanTracker
from loramux_engine.outputs import FinishReason
from loramux_engine.request import Request, RequestStatus
from loramux_engine.scheduler import ScheduledRequest, SchedulerOutput
from loramux_core.sampling import SamplingParams


def test_step_plan_round_trip():
    plan = StepPlan(forget=(3, 9), slot_ops=((SLOT_LOAD, 1, 4), (RETIRE, -1, 3), (HOST_DROP, -1, 2)),
                    seqs=(SeqPlan(5, 0, 7, -1, False, (1, 2, 3, 4, 5, 6, 7, 8), True, (4, 9)),
                          SeqPlan(6, 40, 1, 2, True, (300,), False, ()),
                          SeqPlan(7, 16, 1, 0, True, (), False, (11,))))
    t = encode_step(plan)
    assert t.dtype == torch.int64 and t.dim() == 1
    assert decode_step(t) == plan
    assert decode_step(encode_step(StepPlan())) == StepPlan()


def test_add_adapter_round_trip_keeps_unicode_paths():
    path = "/adapters/café 你好/v2"
    assert decode_add_adapter(encode_add_adapter(12, path, "ab12")) == (12, path, "ab12")


def _entry(req, start, n, blocks, slot=-1):
    return ScheduledRequest(req, start, n, tuple(blocks), slot, start + n == req.num_tokens)


def _check_same(ours: SchedulerOutput, mirrored: SchedulerOutput):
    assert len(ours.scheduled) == len(mirrored.scheduled)
    for a, b in zip(ours.scheduled, mirrored.scheduled):
        assert b.request.all_token_ids == a.request.all_token_ids
        assert (b.start, b.num_new_tokens, b.block_ids, b.slot, b.samples) == \
            (a.start, a.num_new_tokens, a.block_ids, a.slot, a.samples)


def test_tracker_sends_only_changes_and_mirror_rebuilds_each_step():
    tracker, mirror = PlanTracker(), RequestMirror()
    a = Request("a", list(range(10, 30)), SamplingParams())   # 20 tokens: two chunks
    b = Request("b", [5, 6, 7], SamplingParams())

    def step(out, ops=()):
        plan = decode_step(encode_step(tracker.plan(out, list(ops))))
        _check_same(out, mirror.apply(plan))
        return plan

    # step 1: a's first chunk, b's whole prompt; every token and block is new
    p = step(SchedulerOutput([_entry(a, 0, 12, [3]), _entry(b, 0, 3, [8], slot=1)]),
             [(SLOT_LOAD, 1, 1)])
    assert [len(s.new_tokens) for s in p.seqs] == [20, 3] and p.slot_ops == ((SLOT_LOAD, 1, 1),)
    b.append_token(99)
    # step 2: b decodes (one new token, no new block), a's second chunk grows a block
    p = step(SchedulerOutput([_entry(b, 3, 1, [8], slot=1), _entry(a, 12, 8, [3, 4])]))
    assert [(s.new_tokens, s.new_blocks, s.reset_blocks) for s in p.seqs] == \
        [((99,), (), False), ((), (4,), False)]
    # step 3: a was preempted and resumes on other blocks: its table is sent whole
    a.append_token(42)
    p = step(SchedulerOutput([_entry(a, 0, 21, [6, 1])]))
    assert p.seqs[0].reset_blocks and p.seqs[0].new_blocks == (6, 1)
    assert p.seqs[0].new_tokens == (42,)
    # step 4: b finished; the workers forget it, a decodes on
    b.status, b.finish_reason = RequestStatus.FINISHED, FinishReason.LENGTH
    a.append_token(43)
    p = step(SchedulerOutput([_entry(a, 21, 1, [6, 1])]))
    assert p.forget == (2,) and len(mirror) == 1 and len(tracker) == 1


def test_mirror_keeps_one_block_tuple_until_the_table_changes():
    """The worker's graph input fill rewrites a block-table row only when the row's tuple
    object changes (DecodeStaging.fill), as on rank 0, whose scheduler hands the same tuple
    until the table grows: the mirror does the same, and the tracker sends no blocks for
    a table that did not change, the same tuple or an equal one."""
    tracker, mirror = PlanTracker(), RequestMirror()
    a = Request("a", [1, 2, 3], SamplingParams())

    def step(start, n, blocks):
        out = SchedulerOutput([ScheduledRequest(a, start, n, blocks, -1, True)])
        plan = decode_step(encode_step(tracker.plan(out, [])))
        mirrored = mirror.apply(plan).scheduled[0].block_ids
        assert mirrored == blocks
        return plan.seqs[0], mirrored

    table = (4,)
    _, first = step(0, 3, table)
    a.append_token(7)
    seq, second = step(3, 1, table)
    assert second is first and seq.new_blocks == () and not seq.reset_blocks
    a.append_token(8)
    seq, grown = step(4, 1, (4, 9))
    assert grown is not first and seq.new_blocks == (9,)
    a.append_token(9)
    seq, same = step(5, 1, tuple([4, 9]))   # an equal tuple, not the same object
    assert same is grown and seq.new_blocks == ()
    a.append_token(10)
    seq, moved = step(0, 7, (2, 3))        # preempted and resumed elsewhere: sent whole
    assert seq.reset_blocks and seq.new_blocks == (2, 3) and moved == (2, 3)
