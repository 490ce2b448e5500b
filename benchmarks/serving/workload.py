"""A serving workload, fixed by its seed: when each request arrives (Poisson at a rate, or
all at once for a closed loop), which adapter it names (uniform or Zipf over N adapters),
its prompt (random token ids) and how many tokens it generates. And the summary of what
a run measured: throughput, TTFT / ITL / end-to-end percentiles, SLO attainment."""
from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Request:
    index: int
    arrival_s: float            # offset from the start (0 for every closed-loop request)
    adapter: str | None
    prompt: tuple[int, ...]
    max_tokens: int


@dataclass
class Record:
    """What one request saw, in seconds from the start of its run (the driver's clock)."""
    index: int
    adapter: str | None
    prompt_tokens: int
    sent_s: float | None = None  # None: never sent
    first_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # per output token after the first
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens) each
    error: str | None = None
    cut: bool = False           # still running at the run's time limit: cancelled

    @property
    def sent(self) -> bool:
        return self.sent_s is not None


def parse_lengths(text: str) -> tuple[int, int]:
    """"128" -> (128, 128); "64-256" -> uniform integers in [64, 256]."""
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise ValueError(f"length {text!r}: want N or LO-HI with 1 <= LO <= HI")
    return lo_i, hi_i


def parse_popularity(text: str) -> float | None:
    """"uniform" -> None; "zipf" -> 1.0; "zipf:1.2" -> 1.2 (the exponent alpha)."""
    if text == "uniform":
        return None
    name, _, alpha = text.partition(":")
    if name != "zipf":
        raise ValueError(f"popularity {text!r}: want uniform, zipf or zipf:ALPHA")
    return float(alpha or 1.0)


def adapter_weights(n: int, alpha: float | None) -> list[float]:
    """Request share of adapter i (rank i+1): uniform, or proportional to 1/(i+1)^alpha."""
    if alpha is None:
        return [1.0] * n
    return [1.0 / (i + 1) ** alpha for i in range(n)]


def make_workload(num_requests: int, adapters: list[str | None], alpha: float | None,
                  input_len: tuple[int, int], output_len: tuple[int, int], vocab: range,
                  rate: float | None, seed: int) -> list[Request]:
    """`rate` None: a closed loop (every arrival 0; the driver keeps C in flight). The
    popularity ranks are a seeded shuffle of `adapters`, so "a0" is not always the top."""
    rng = random.Random(seed)
    ranked = list(adapters)
    rng.shuffle(ranked)
    cum = list(itertools.accumulate(adapter_weights(len(ranked), alpha)))  # once, not per
    out, t = [], 0.0                                                          # request
    for i in range(num_requests):
        if rate is not None:
            t += rng.expovariate(rate)
        n_in = rng.randint(*input_len)
        prompt = tuple(rng.choices(vocab, k=n_in))
        out.append(Request(i, t if rate is not None else 0.0,
                           rng.choices(ranked, cum_weights=cum)[0], prompt,
                           rng.randint(*output_len)))
    return out


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _dist(values: list[float]) -> dict:
    return {f"p{q}": percentile(values, q) for q in (50, 90, 99)} | {
        "mean": sum(values) / len(values) if values else None}


def summarize(records: list[Record], wall_s: float, slo_ttft_s: float,
              slo_itl_s: float) -> dict:
    """Throughput over the run's wall time (every token delivered, also to requests cut at
    the run's limit); latency distributions over completed requests. Requests never sent
    (the run's send limit came first) do not count. SLO attainment: the share of the sent
    requests that completed with TTFT <= slo_ttft_s and a mean inter-token latency (time
    per output token after the first) <= slo_itl_s."""
    unsent = sum(1 for r in records if not r.sent and r.error is None)
    records = [r for r in records if r.sent or r.error is not None]
    done = [r for r in records if r.error is None and r.end_s is not None]
    ttft = [r.first_s - r.sent_s for r in done if r.first_s is not None]
    itl = [g for r in done for g in r.gaps]
    e2e = [r.end_s - r.sent_s for r in done]
    ok = sum(1 for r in done if r.first_s is not None and r.first_s - r.sent_s <= slo_ttft_s
             and (not r.gaps or sum(r.gaps) / len(r.gaps) <= slo_itl_s))
    out_tokens = sum(r.tokens for r in records if r.error is None)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "requests": len(records), "completed": len(done), "errors": errors,
        "cut": sum(r.cut for r in records), "unsent": unsent,
        "wall_s": wall_s, "req_per_s": len(done) / wall_s if wall_s > 0 else None,
        "output_tok_per_s": out_tokens / wall_s if wall_s > 0 else None,
        "output_tokens": out_tokens, "prompt_tokens": sum(r.prompt_tokens for r in done),
        "ttft_s": _dist(ttft), "itl_s": _dist(itl), "e2e_s": _dist(e2e),
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s,
                "attainment": ok / len(records) if records else None},
    }


def _chunk_gaps(rec: Record, start_s: float, end_s: float) -> tuple[int, list[float]]:
    """rec's output tokens that arrived in [start_s, end_s), and the per-token gaps of
    those after its first token (a chunk of n tokens: n gaps of (its time - the last) / n)."""
    tokens, gaps, last = 0, [], None
    for t, n in rec.chunks:
        if start_s <= t < end_s:
            tokens += n
            if last is not None:
                gaps.extend([(t - last) / n] * n)
        last = t
    return tokens, gaps


def summarize_window(records: list[Record], start_s: float, end_s: float, slo_ttft_s: float,
                     slo_itl_s: float, stopped_s: float | None = None) -> dict:
    """A steady-state window of a run (times in seconds from its start): throughput is the
    tokens that arrived in [start_s, end_s) over its length, whatever request they belong
    to; latencies are those of the requests sent in the window (TTFT, end-to-end when they
    completed) and the gaps between tokens that arrived in it. A request sent in the window
    that had no first token when the run stopped (`stopped_s`, its end by default) counts
    with stopped_s - sent as its TTFT (a lower bound: `ttft_censored` says how many). SLO
    attainment: the share of the requests sent in the window whose TTFT <= slo_ttft_s and
    whose mean gap so far <= slo_itl_s."""
    length = end_s - start_s
    stopped = end_s if stopped_s is None else stopped_s
    sent = [r for r in records if r.sent and start_s <= r.sent_s < end_s]
    tokens, itl = 0, []
    for r in records:
        if r.error is None:
            n, g = _chunk_gaps(r, start_s, end_s)
            tokens += n
            itl += g
    ok_sent = [r for r in sent if r.error is None]
    ttft = [(r.first_s if r.first_s is not None else stopped) - r.sent_s for r in ok_sent]
    censored = sum(1 for r in ok_sent if r.first_s is None)
    done = [r for r in ok_sent if r.end_s is not None]
    ended = [r for r in records if r.error is None and r.end_s is not None
             and start_s <= r.end_s < end_s]
    ok = sum(1 for r in ok_sent if r.first_s is not None and r.first_s - r.sent_s <= slo_ttft_s
             and (not r.gaps or sum(r.gaps) / len(r.gaps) <= slo_itl_s))
    errors: dict[str, int] = {}
    for r in sent:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "window_s": [start_s, end_s], "requests": len(sent), "completed": len(done),
        "errors": errors, "cut": sum(r.cut for r in sent), "unsent": 0,
        "ttft_censored": censored, "wall_s": length,
        "req_per_s": len(ended) / length if length > 0 else None,
        "output_tok_per_s": tokens / length if length > 0 else None,
        "output_tokens": tokens, "prompt_tokens": sum(r.prompt_tokens for r in ok_sent),
        "ttft_s": _dist(ttft), "itl_s": _dist(itl),
        "e2e_s": _dist([r.end_s - r.sent_s for r in done]),
        "slo": {"ttft_s": slo_ttft_s, "itl_s": slo_itl_s,
                "attainment": ok / len(sent) if sent else None},
    }
