"""Loading the benchmark's adapters, many at once: through the control plane (LoadAdapter
RPCs from a thread pool, `workers` in flight) and into the offline engine (disk reads on
a thread pool, each registered on this thread as it completes, as the engine server does).
Both report the wall time and each load's own latency."""
from __future__ import annotations

import math
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving.workload import percentile


@dataclass(frozen=True)
class LoadReport:
    adapters: int
    workers: int                 # loads allowed in flight at once
    wall_s: float
    latency_s: tuple[float, ...]  # each load's own time, call to reply
    max_in_flight: int = 0        # the most loads that were in flight at once

    def summary(self) -> dict:
        lat = list(self.latency_s)
        return {"adapters": self.adapters, "workers": self.workers, "wall_s": self.wall_s,
                "max_in_flight": self.max_in_flight,
                "per_adapter_ms": 1e3 * self.wall_s / self.adapters if self.adapters else None,
                "latency_ms": {f"p{q}": 1e3 * percentile(lat, q) if lat else None
                               for q in (50, 99)}}

    def __str__(self) -> str:
        if not self.latency_s:
            return "no adapters"
        s = self.summary()
        return (f"{self.adapters} adapters in {self.wall_s:.1f} s with {self.workers} in "
                f"flight: {s['per_adapter_ms']:.1f} ms per adapter, each load "
                f"p50 {s['latency_ms']['p50']:.0f} / p99 {s['latency_ms']['p99']:.0f} ms")


class _Progress:
    """Loads in flight (and the most at once), and a line every `every_s` seconds while
    loads go on (a long load is not a hang)."""

    def __init__(self, total: int, label: str, every_s: float = 10.0):
        self.total, self.label, self.every_s = total, label, every_s
        self.done, self._next = 0, time.monotonic() + every_s
        self.in_flight = self.max_in_flight = 0
        self._lock = threading.Lock()

    def start(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)

    def tick(self) -> None:
        with self._lock:
            self.in_flight -= 1
            self.done += 1
            if time.monotonic() >= self._next:
                self._next = time.monotonic() + self.every_s
                print(f"  {self.label}: {self.done}/{self.total} adapters loaded", flush=True)


def load_service(control_address: str, names: list[str], workers: int,
                 within_s: float | None = None, timeout_s: float = 600.0) -> LoadReport:
    """LoadAdapter(name, path=name) for the names in order, `workers` calls in flight on
    one channel. Raises the first failure (a benchmark on missing adapters means nothing).
    within_s: no load starts later than this; the report then covers the names loaded
    without a gap from the first."""
    from loramux import AdminClient

    progress = _Progress(len(names), "service")
    t0 = time.perf_counter()
    stop = t0 + (math.inf if within_s is None else within_s)

    def load(name: str) -> float | None:
        t = time.perf_counter()
        if t > stop:
            return None
        progress.start()
        admin.load(name, name)
        progress.tick()
        return time.perf_counter() - t

    with AdminClient(control_address, timeout=timeout_s) as admin:
        pool = ThreadPoolExecutor(max(1, workers))
        try:
            latency = list(pool.map(load, names))
        finally:  # interrupted: the queued loads are dropped, not run
            pool.shutdown(wait=True, cancel_futures=True)
        wall = time.perf_counter() - t0
    loaded = latency.index(None) if None in latency else len(latency)
    if loaded < len(names):
        print(f"  service: loads stopped after {within_s:g} s: {loaded} of {len(names)} "
              f"adapters", flush=True)
    return LoadReport(loaded, workers, wall, tuple(latency[:loaded]), progress.max_in_flight)


def load_offline(engine, root: Path, names: list[str], workers: int) -> LoadReport:
    """engine.read_adapter for every name on `workers` threads (at most `workers` reads
    held at once: a read holds the adapter's host copy), each registered on this thread
    as soon as it is read."""
    progress = _Progress(len(names), "offline")

    def read(name: str):
        t = time.perf_counter()
        progress.start()
        return engine.read_adapter(name, str(root / name)), t

    latency = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, workers)) as pool:
        todo, running = list(reversed(names)), set()
        while todo or running:
            while todo and len(running) < max(1, workers):
                running.add(pool.submit(read, todo.pop()))
            done, running = wait(running, return_when=FIRST_COMPLETED)
            for fut in done:
                adapter, t = fut.result()
                engine.register_adapter(adapter)
                latency.append(time.perf_counter() - t)
                progress.tick()
    return LoadReport(len(names), workers, time.perf_counter() - t0, tuple(latency),
                      progress.max_in_flight)
