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



class ServiceLoader:
    """LoadAdapter calls in the background, on threads of their own, while points run:
    names loaded in the order queued, `workers` calls in flight. `loaded` is the longest
    prefix of the names all loaded (points use the first N names); `done_at` the
    perf_counter time each load completed (how many loads fell in a point's window). While
    a batch loads, a line every `every_s` seconds gives its loads per second and each
    load's latency so far. A failed load stops the loading (`error`); close() drops the
    loads not started."""

    def __init__(self, control_address: str, workers: int, timeout_s: float = 600.0,
                 every_s: float = 5.0):
        from loramux import AdminClient

        self._admin = AdminClient(control_address, timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="load")
        self.workers = max(1, workers)
        self._cv = threading.Condition()
        self._names: list[str] = []
        self.latency_s: list[float | None] = []
        self.done_at: list[float | None] = []
        self.batches: list[tuple[int, int, float]] = []  # (first index, count, start time)
        self.loaded = self.in_flight = self.max_in_flight = 0
        self.error: str | None = None
        self._closing = False
        self.every_s = every_s
        self._next_line = 0.0

    def start(self, names: list[str]) -> None:
        """Queue `names` after those queued before (one batch); returns at once."""
        with self._cv:
            first = len(self._names)
            self._names += names
            self.latency_s += [None] * len(names)
            self.done_at += [None] * len(names)
            self.batches.append((first, len(names), time.perf_counter()))
            self.max_in_flight = self.in_flight  # per batch (batches rarely overlap)
            self._next_line = time.perf_counter() + self.every_s
        for i in range(first, first + len(names)):
            self._pool.submit(self._load, i)

    def load_now(self, names: list[str]) -> dict:
        """Load `names` as one batch and wait for them; that batch's report."""
        self.start(names)
        self.wait_for(len(self._names))
        if self.error:
            raise RuntimeError(self.error)
        return self.batch_report(len(self.batches) - 1)

    def _load(self, i: int) -> None:
        with self._cv:
            if self.error is not None or self._closing:
                return
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        t = time.perf_counter()
        try:
            self._admin.load(self._names[i], self._names[i])
        except Exception as err:  # noqa: BLE001 - reported; points needing it are skipped
            with self._cv:
                self.error = self.error or f"loading {self._names[i]}: {err}"
                self.in_flight -= 1
                self._cv.notify_all()
            return
        now = time.perf_counter()
        with self._cv:
            self.in_flight -= 1
            self.latency_s[i], self.done_at[i] = now - t, now
            while self.loaded < len(self._names) and self.done_at[self.loaded] is not None:
                self.loaded += 1
            batch = len(self.batches) - 1
            first, count, _ = self.batches[batch]
            if now >= self._next_line or self.loaded == first + count:
                self._next_line = now + self.every_s
                print(f"  service: {self._line(batch)}", flush=True)
            self._cv.notify_all()

    def batch_report(self, batch: int) -> dict:
        """Loads done of a batch, their loads per second from the batch's start to its
        last completed load, each load's latency, the most loads seen in flight."""
        with self._cv:
            first, count, t0 = self.batches[batch]
            done = [(self.done_at[i], self.latency_s[i]) for i in range(first, first + count)
                    if self.done_at[i] is not None]
        wall = max((t for t, _ in done), default=t0) - t0
        lat = [x for _, x in done]
        return {"adapters": len(done), "queued": count, "wall_s": wall,
                "loads_per_s": len(done) / wall if wall > 0 else None,
                "per_adapter_ms": 1e3 * wall / len(done) if done else None,
                "workers": self.workers, "max_in_flight": self.max_in_flight,
                "latency_ms": {f"p{q}": 1e3 * percentile(lat, q) if lat else None
                               for q in (50, 99)}}

    def _line(self, batch: int) -> str:
        r = self.batch_report(batch)
        lat = r["latency_ms"]
        rate = "-" if r["loads_per_s"] is None else f"{r['loads_per_s']:.1f}"
        return (f"{self.loaded} adapters loaded; this batch {r['adapters']}/{r['queued']} in "
                f"{r['wall_s']:.1f} s ({rate} loads/s, {r['max_in_flight']} in flight at most"
                + (f"; each load p50 {lat['p50']:.0f} / p99 {lat['p99']:.0f} ms)"
                   if lat["p50"] is not None else ")"))

    @property
    def busy(self) -> bool:
        """Loads queued or in flight (and no failure)."""
        with self._cv:
            return self.error is None and any(t is None for t in self.done_at)

    def wait_for(self, n: int, timeout_s: float | None = None) -> bool:
        """Wait until the first `n` names are loaded (False: timed out, or loading failed)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cv:
            while self.loaded < n and self.error is None:
                left = 1.0 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 1.0))
            return self.loaded >= n

    def loads_between(self, t_a: float, t_b: float) -> int:
        """Loads completed in [t_a, t_b) (perf_counter times)."""
        with self._cv:
            return sum(1 for t in self.done_at if t is not None and t_a <= t < t_b)

    def close(self) -> None:
        with self._cv:
            self._closing = True  # loads not started yet return at once
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._admin.close()
