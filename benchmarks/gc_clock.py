"""Every collection of CPython's cyclic collector, timed (for benchmarks that look for
host stalls): generation, wall time, objects collected."""
from __future__ import annotations

from typing import NamedTuple

from loramux_core.gc_heap import CollectionTimer


class Collection(NamedTuple):
    start: float      # time.perf_counter()
    seconds: float
    generation: int
    collected: int


class GcClock(CollectionTimer):
    """Records every collection from construction on."""

    def __init__(self):
        super().__init__()
        self.events: list[Collection] = []
        self.install()

    def collected(self, start: float, seconds: float, info: dict) -> None:
        self.events.append(Collection(start, seconds, info["generation"], info["collected"]))

    def between(self, t0: float, t1: float) -> list[Collection]:
        """The collections that started in [t0, t1)."""
        return [e for e in self.events if t0 <= e.start < t1]
