"""The plan channel over a real two-rank gloo control group (two threads): payloads that
fit the first broadcast, that fill it exactly, that spill into a second one, and none, in
one sequence; each arrives whole and in order, and a reused buffer never leaks into an
earlier payload."""
from __future__ import annotations

import torch

from loramux_engine.distributed.channel import FIRST, PlanChannel
from tests.support.ranks import two_ranks

SIZES = [5, 0, FIRST - 3, FIRST - 2, 3 * FIRST + 7, 1, 600]


def _payload(i: int, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(i)
    return torch.randint(-2**40, 2**40, (n,), generator=gen, dtype=torch.int64)


def test_messages_arrive_whole_and_in_order():
    def rank(r, groups):
        ch = PlanChannel(groups.control, r)
        got = []
        for i, n in enumerate(SIZES):
            if r == 0:
                ch.send(10 + i, _payload(i, n) if n else None)
            else:
                got.append(ch.recv())
        return got
    got = two_ranks(rank)[1]
    assert [op for op, _ in got] == [10 + i for i in range(len(SIZES))]
    for i, (n, (_, payload)) in enumerate(zip(SIZES, got)):
        if n == 0:
            assert payload is None
        else:
            assert torch.equal(payload, _payload(i, n)), (i, n)
