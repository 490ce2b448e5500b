"""What one invocation of the serving benchmark runs: its points (adapter count x
popularity x load, each with its own seeded workload), the untimed warm-up round, and the
time budget (each point bounded by Limits, the whole run by a deadline)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from benchmarks.serving.drivers import Limits
from benchmarks.serving.workload import Request, make_workload, parse_popularity


@dataclass(frozen=True)
class Load:
    rate: float | None          # Poisson arrivals, requests/s (None: closed loop)
    concurrency: int | None     # closed loop: streams in flight

    def __str__(self) -> str:
        return f"{self.rate:g} req/s" if self.rate is not None else f"{self.concurrency} streams"


SEED_STEP = 1_000  # a repeat of a point (steady, during loads) draws its own workload


def parse_point_specs(text: str) -> list[tuple[int, str]]:
    """"5/zipf:1,32/uniform" -> [(5, "zipf:1"), (32, "uniform")] (each checked)."""
    out = []
    for item in text.split(","):
        n, sep, pop = item.strip().partition("/")
        if not sep or not n.isdigit() or int(n) < 1:
            raise ValueError(f"point {item!r}: want N/POPULARITY, e.g. 1000/zipf:1")
        parse_popularity(pop)
        out.append((int(n), pop))
    return out


def make_points(counts: list[int], popularities: list[tuple[str, float | None]],
                loads: list[Load], num_requests, names: tuple[str, ...], input_len, output_len,
                vocab: range, seed: int, repeat_first: bool,
                specs: list[tuple[int, str]] | None = None,
                during_loads: bool = False) -> list[dict]:
    """One point per (load, adapter count, popularity), in that nesting order (so the
    first load is measured at every count before the next load); a single adapter gets the
    first popularity only (there is nothing to be popular among). `specs`, when given, are
    the (count, popularity) pairs in their order instead.
    `num_requests(load)` sizes each workload; a point's workload is drawn when it runs
    (workload(p)), each point from its own seed. repeat_first: the first point runs twice,
    marked round "first" (the first timed round after start) and "steady". during_loads:
    then once more, round "during loads" (while the other adapters load)."""
    if specs is None:
        specs = [(n, pop) for n in counts
                 for pop, _ in (popularities if n > 1 else popularities[:1])]
    points = []
    for load in loads:
        for n, pop in specs:
            points.append(_point(n, pop, load, num_requests(load), names, input_len,
                                 output_len, vocab, seed + SEED_STEP * len(points)))
    if points and (repeat_first or during_loads):
        first = points[0]
        extra = ([("steady", 1)] if repeat_first else []) + (
            [("during loads", 2)] if during_loads else [])
        for k, (name, step) in enumerate(extra):
            points.insert(1 + k, _point(first["adapters"], first["popularity"],
                                        Load(first["rate"], first["concurrency"]),
                                        first["requests"], names, input_len, output_len,
                                        vocab, first["seed"] + step * 7919, name))
        if repeat_first:
            first["round"] = "first"
    return points


def _point(n: int, pop: str, load: Load, requests: int, names, input_len, output_len,
           vocab: range, seed: int, round_: str | None = None) -> dict:
    alpha = parse_popularity(pop)
    return {"adapters": n, "popularity": pop, "rate": load.rate,
            "concurrency": load.concurrency, "round": round_, "requests": requests,
            "seed": seed, "_make": lambda: make_workload(requests, list(names[:n]), alpha,
                                                         input_len, output_len, vocab,
                                                         load.rate, seed)}


def workload(p: dict) -> list[Request]:
    """p's workload (drawn on first use, kept until release(p))."""
    if "workload" not in p:
        p["workload"] = p["_make"]()
    return p["workload"]


def release(p: dict) -> None:
    p.pop("workload", None)


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
