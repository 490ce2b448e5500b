"""What one invocation of the serving benchmark runs: its points (adapter count x
popularity x load, each with its own seeded workload), the untimed warm-up round, and the
time budget (each point bounded by Limits, the whole run by a deadline)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from benchmarks.serving.drivers import Limits
from benchmarks.serving.workload import Request, make_workload


@dataclass(frozen=True)
class Load:
    rate: float | None          # Poisson arrivals, requests/s (None: closed loop)
    concurrency: int | None     # closed loop: streams in flight

    def __str__(self) -> str:
        return f"{self.rate:g} req/s" if self.rate is not None else f"{self.concurrency} streams"


def make_points(counts: list[int], popularities: list[tuple[str, float | None]],
                loads: list[Load], num_requests, names: tuple[str, ...], input_len, output_len,
                vocab: range, seed: int, repeat_first: bool) -> list[dict]:
    """One point per (load, adapter count, popularity), in that nesting order (so the
    first load is measured at every count before the next load); a single adapter gets the
    first popularity only (there is nothing to be popular among).
    `num_requests(load)` sizes each workload. repeat_first: the first point runs twice,
    marked round "first" (the first timed round after start) and "steady"."""
    points = []
    for load in loads:
        for n in counts:
            for pop, alpha in (popularities if n > 1 else popularities[:1]):
                wl = make_workload(num_requests(load), list(names[:n]), alpha, input_len,
                                   output_len, vocab, load.rate, seed)
                points.append({"adapters": n, "popularity": pop, "rate": load.rate,
                               "concurrency": load.concurrency, "round": None,
                               "workload": wl})
    if repeat_first and points:
        points.insert(1, dict(points[0], round="steady"))
        points[0]["round"] = "first"
    return points


def warmup_round(points: list[dict], names: tuple[str, ...], input_len, vocab: range,
                 seed: int) -> tuple[list[Request], int]:
    """A closed loop as wide as the widest load (32 streams for rate runs), prompts from
    the runs' length range, outputs of 4-32 tokens so the batch ramps down through every
    size, over every adapter the runs use (and the base model): first slot copies and
    anything the engine's start-up warm-up left cold happen here, not in a point.
    Returns (workload, streams)."""
    width = max(p["concurrency"] or 32 for p in points)
    used = list(names[:max(p["adapters"] for p in points)])
    return make_workload(2 * width, [None, *used], None, input_len, (4, 32), vocab, None,
                         seed + 1), width


@dataclass(frozen=True)
class Budget:
    """Each point runs under `limits`; a point whose worst case (limits.total_s, when
    finite) would end past the deadline is skipped, so the run ends with its table."""
    limits: Limits
    deadline: float = math.inf   # time.monotonic() value

    @classmethod
    def starting_now(cls, limits: Limits, seconds: float | None) -> "Budget":
        return cls(limits, math.inf if seconds is None else time.monotonic() + seconds)

    def left_s(self) -> float:
        return self.deadline - time.monotonic()

    def fits(self, extra_s: float = 0.0) -> bool:
        worst = self.limits.total_s if math.isfinite(self.limits.total_s) else 0.0
        return self.left_s() >= worst + extra_s
