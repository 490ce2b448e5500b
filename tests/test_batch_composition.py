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


def test_a_disk_read_is_no_starvation():
    """A request whose adapter is being read from disk while slots are free: the steps
    its read is in flight do not count toward starvation, so no drain pauses the
    requests behind it; once its read has landed it takes a free slot at once."""
    s = make(max_loras=4, budget=64)
    K = s.cfg.starvation_steps
    reading = {9}
    s.reading = reading.__contains__  # adapter 9's read is in flight
    s.add(req("cold", 3, adapter=9, max_tokens=2))
    waits = []
    for t in range(3 * K):
        arrived = f"hot{t}"
        s.add(req(arrived, 3, adapter=1 + t % 2, max_tokens=2))
        _step_reading(s, reading)
        waits.append(0 if s.get(arrived) is None or s.get(arrived).num_computed_tokens else 1)
        assert s.drain_threshold() is None, t
    assert sum(waits) == 0  # every newer request was admitted at its first step
    reading.clear()  # the read landed
    _step_reading(s, reading)
    _step_reading(s, reading)
    assert s.get("cold") is None or s.get("cold").num_computed_tokens


def _step_reading(s, reading: set) -> None:
    """`step`, with the adapters in `reading` left out of the slots (their reads are in
    flight)."""
    wanted = s.wanted_adapters
    s.wanted_adapters = lambda: [a for a in wanted() if a not in reading]
    try:
        step(s)
    finally:
        del s.wanted_adapters
