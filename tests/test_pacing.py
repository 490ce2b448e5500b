"""BusyPacer: the next costly publication waits a multiple of what the last one cost
(the adapter table of the control plane, the events of the engine). Times are given, not
read from a clock."""
from __future__ import annotations

import pytest

from loramux_core.pacing import BUSY_FACTOR, BusyPacer


def test_first_run_at_once_then_factor_times_the_cost_after_its_start():
    pacer = BusyPacer(factor=10)
    assert pacer.next_at() == 0.0
    pacer.ran(100.0, 100.5)
    assert pacer.next_at() == pytest.approx(105.0)
    pacer.ran(105.0, 105.01)   # only the last run counts
    assert pacer.next_at() == pytest.approx(105.1)


def test_min_gap_when_runs_are_cheap():
    pacer = BusyPacer(factor=10, min_gap_s=0.01)
    pacer.ran(7.0, 7.0001)
    assert pacer.next_at() == pytest.approx(7.01)
    pacer.ran(8.0, 8.2)
    assert pacer.next_at() == pytest.approx(10.0)


@pytest.mark.parametrize("cost_per_name", [1e-6, 1e-4])
def test_runs_as_soon_as_allowed_take_one_factor_th_of_the_time(cost_per_name):
    """A steady stream of changes, each run listing ever more names: the runs' share of
    the thread stays 1/factor, while the list grows."""
    pacer, now, busy = BusyPacer(min_gap_s=0.001), 50.0, 0.0
    start = now
    for names in range(100, 5000, 50):
        now = max(now, pacer.next_at())
        cost = names * cost_per_name
        pacer.ran(now, now + cost)
        now, busy = now + cost, busy + cost
    assert busy / (pacer.next_at() - start) <= 1 / BUSY_FACTOR + 1e-9


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="must be >= 0"):
        BusyPacer(factor=-1)
    with pytest.raises(ValueError, match="must be >= 0"):
        BusyPacer(min_gap_s=-0.1)
