"""How soon a costly publication may follow the last one.

The control plane's adapter table and the engine's events each list everything (every
adapter name, every loaded adapter), so each costs time growing with that list, and each
is wanted soon after every change. Sent at every change of a steady stream of changes,
they would take a share of their thread that grows with the list. Instead the next one
waits BUSY_FACTOR times what the last one cost, counted from when the last one started:
they then take about 1/BUSY_FACTOR of the thread, whatever the size of the list.
"""
from __future__ import annotations

BUSY_FACTOR = 10


class BusyPacer:
    """Spaces out one repeated, costly piece of work. Not thread-safe: one owner."""

    def __init__(self, factor: float = BUSY_FACTOR, min_gap_s: float = 0.0):
        if factor < 0 or min_gap_s < 0:
            raise ValueError(f"factor={factor}, min_gap_s={min_gap_s}: must be >= 0")
        self._factor = factor
        self._min_gap_s = min_gap_s
        self._start = 0.0  # when the last run started (time.monotonic())
        self._cost = 0.0   # how long it took (s)

    def ran(self, start: float, end: float) -> None:
        """Record one run, from `start` to `end` (time.monotonic())."""
        self._start, self._cost = start, end - start

    def next_at(self) -> float:
        """The earliest time (time.monotonic()) at which the next run may start:
        `factor` times the last run's cost after it started, and at least `min_gap_s`
        after it. Before any run: at once."""
        return self._start + max(self._min_gap_s, self._factor * self._cost)
