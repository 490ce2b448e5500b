"""Every collection of CPython's cyclic collector, timed (for benchmarks that look for
host stalls): generation, wall time, objects collected."""
from __future__ import annotations

import gc
import time
from typing import NamedTuple


class Collection(NamedTuple):
    start: float      # time.perf_counter()
    seconds: float
    generation: int
    collected: int


class GcClock:
    """Records every collection from construction on (gc.callbacks)."""

    def __init__(self):
        self.events: list[Collection] = []
        self._start = 0.0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._start = now
        else:
            self.events.append(Collection(self._start, now - self._start, info["generation"],
                                          info["collected"]))

    def between(self, t0: float, t1: float) -> list[Collection]:
        """The collections that started in [t0, t1)."""
        return [e for e in self.events if t0 <= e.start < t1]
