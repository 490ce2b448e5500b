"""Batch composition when adapters outnumber slots: while nothing starves, a freed slot
goes to the adapter with the most waiting requests (more requests run per step); once a
request starves, the order is by age again and it is admitted within the fairness bound."""
from tests.test_scheduler import make, req, step


def test_slot_goes_to_the_adapter_with_most_waiting_requests():
    s = make(max_loras=1, budget=64)
    s.add(req("a0", 3, adapter=1))                # oldest, alone
    for i in range(5):
        s.add(req(f"b{i}", 3, adapter=2))
    assert s.wanted_adapters() == [2, 1]
    out = step(s)
    assert {x.request.request_id for x in out.scheduled} == {f"b{i}" for i in range(5)}


def test_ties_keep_age_order():
    s = make(max_loras=1)
    s.add(req("a0", 3, adapter=3))
    s.add(req("b0", 3, adapter=4))
    s.add(req("a1", 3, adapter=3))
    s.add(req("b1", 3, adapter=4))
    assert s.wanted_adapters() == [3, 4]


def test_starving_request_gets_the_slot_within_the_bound():
    """A lone request of one adapter behind a stream of another adapter's requests: it
    starves after K steps, then the age order and the drain admit it."""
    s = make(max_loras=1, budget=64)
    K = s.cfg.starvation_steps
    s.add(req("lone", 3, adapter=1, max_tokens=2))
    admitted_at, n = None, 0
    for t in range(200):
        for _ in range(2):                        # adapter 2 always has more waiting
            s.add(req(f"hot{n}", 3, adapter=2, max_tokens=4))
            n += 1
        if t == K:
            assert s.wanted_adapters()[0] == 1    # starving: age order
        out = step(s)
        if any(x.request.request_id == "lone" for x in out.scheduled):
            admitted_at = t
            break
    # D = 1 prompt step + 4 tokens; L = 3 steps to place an adapter (engine/scheduler.py)
    assert admitted_at is not None and admitted_at <= K + 2 * (5 + 3), admitted_at
