"""Latency and size distributions the engine records for its metrics: fixed-bucket
histograms, cheap to observe on the step thread, shipped whole in every EngineEvent (engine/server/events.py) (the
gateway serves them on its Prometheus endpoint).

Counts only grow for the life of the process, as Prometheus expects of a histogram; a new
engine process starts from zero, which Prometheus reads as a counter reset."""
from __future__ import annotations

import bisect

from loramux_core.gc_heap import CollectionTimer

STEP_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
LOAD_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
GC_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5)


class Histogram:
    """Counts per bucket (the last one is +Inf) and the sum of observed values."""

    def __init__(self, name: str, bounds: tuple[float, ...]):
        self.name = name
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class GcPauses(CollectionTimer):
    """Every collection of CPython's cyclic collector in this process while installed (a
    context manager), timed into a histogram. A collection holds every thread: on the step
    thread it adds its time to one step's time to the next token
    (loramux_core/gc_heap.py says why the long ones are gone)."""

    def __init__(self):
        super().__init__()
        self.histogram = Histogram("gc_pause_seconds", GC_SECONDS)

    def collected(self, start: float, seconds: float, info: dict) -> None:
        self.histogram.observe(seconds)
