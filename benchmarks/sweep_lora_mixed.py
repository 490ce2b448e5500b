"""Sweep the mixed-adapter decode kernels' launch parameters (kernels/lora/mixed.py)
against the token kernels at 256, 128 and 64 tokens over 64 adapters (rank 16, bf16,
Llama-3-8B layer groups), within a time budget, and print the TABLE rows they give.

    python benchmarks/sweep_lora_mixed.py --out DIR [--budget SECONDS] [--slots N]

Per (tokens, group), the 256-token points first: the token kernels and the segment
kernels at the automatic parameters (both checked against the torch reference), then,
while the point's share of the budget lasts, coordinate descent timing shrink + expand
together (so partial sums left to the expand are paid for): split_k and reduce, then
tpp and block_n, then programs, then (warps, stages) and block_k. split_k, tpp and
programs compile nothing new, so most candidates cost only their timing. --slots sizes
the adapter pool as the engine's max_loras (64 used of them; default 256, as
bench_decode). Floors as bench_kernels (PERF.md), from the copy bandwidth measured in the
same run. Writes sweep_mixed.csv and table_rows.txt to DIR; prints a table and the rows
to paste into TABLE (path "tokens" where the token kernels were faster). Needs CUDA.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_kernels import (BF16, _token_kernels, expand_floor_bytes,  # noqa: E402
                                      layer_groups, shrink_floor_bytes)
from benchmarks.common import (copy_bandwidth, floor_seconds, rotating_sets,  # noqa: E402
                               time_graph, write_csv)

TOKENS = [256, 128, 64]
ADAPTERS = 64
RANK = 16
SPLITS = [1, 2, 3, 4, 6, 8, 12, 16]
TPPS = [1, 2, 3, 4, 6, 8, 16]
BLOCK_NS = [128, 64, 256]
BLOCK_KS = [128]
PROGRAMS = [32, 64, 80, 96, 128, 256]
LAUNCH = [(4, 2), (8, 3), (8, 2)]


def graph_time(calls, params) -> float:
    """Seconds per call (CUDA graphs over the rotating sets); params: what is timed."""
    return time_graph(calls)


@dataclasses.dataclass(frozen=True)
class Setup:
    """Where the sweep runs: layer groups (name, K, slice widths), device, timer; the
    tests run it on the CPU interpreter with tiny groups and a stand-in timer."""
    groups: tuple = tuple(layer_groups())
    tokens: tuple = tuple(TOKENS)
    device: str = "cuda"
    dtype: torch.dtype = torch.bfloat16
    timer: object = graph_time


def make_set(setup: Setup, group: str, T: int, slots: int, seed: int):
    """Random x, y and a `slots`-slot rank-16 pool; T tokens round robin over the first
    ADAPTERS slots (shuffled), a few rows without an adapter."""
    from loramux_kernels.lora.launch import build_meta
    _, K, N = next(g for g in setup.groups if g[0] == group)
    g = torch.Generator(device=setup.device).manual_seed(seed)
    kw = dict(device=setup.device, generator=g)
    dt = setup.dtype
    a = (torch.randn(slots, len(N), RANK, K, **kw) / K ** 0.5).to(dt)
    b = (torch.randn(slots, sum(N), RANK, **kw) / RANK ** 0.5).to(dt)
    ts = torch.arange(T, device=setup.device) % ADAPTERS
    ts = ts[torch.randperm(T, device=setup.device, generator=g)]
    ts[: T // 32] = -1
    offsets = tuple(int(v) for v in torch.tensor((0,) + N).cumsum(0))
    return dict(x=torch.randn(T, K, **kw).to(dt), y=torch.randn(T, sum(N), **kw).to(dt),
                a=a, b=b, ts=ts, offsets=offsets, meta=build_meta(ts, slots),
                ranks=torch.full((slots,), RANK, dtype=torch.int32, device=setup.device))


def tokens_pair(s):
    shrink, expand = _token_kernels(len(s["offsets"]) - 1, uniform=False)
    return lambda: expand(s, shrink(s))


def segments_pair(s, params):
    from loramux_kernels.lora.mixed import add_lora_mixed
    return lambda: add_lora_mixed(s["y"], s["x"], s["a"], s["b"], s["meta"], s["offsets"],
                                  s["ranks"], params)


class Point:
    """One (group, tokens) point: its buffer sets, floor, deadline and timings so far."""

    def __init__(self, setup: Setup, group: str, T: int, slots: int, bw: float,
                 deadline: float):
        _, K, N = next(g for g in setup.groups if g[0] == group)
        self.group, self.T, self.K, self.N, self.deadline = group, T, K, N, deadline
        self.timer = setup.timer
        S, L = len(N), ADAPTERS
        per_set = T * K * BF16 + L * S * RANK * K * BF16 + L * sum(N) * RANK * BF16
        self.sets = [make_set(setup, group, T, slots, seed)
                     for seed in range(rotating_sets(per_set))]
        self.floor = floor_seconds(shrink_floor_bytes(T, K, S, RANK, L)
                                   + expand_floor_bytes(T, N, RANK, L), bw, 2)
        self.rows: list[dict] = []
        self.times: dict = {}
        from loramux_kernels.lora.reference import add_lora_ref
        s = self.sets[0]
        self.y0 = s["y"].clone()      # (timing adds into the sets' y over and over)
        self.want = add_lora_ref(self.y0.clone(), s["x"], s["a"], s["b"], s["ts"],
                                 s["offsets"]).float()

    def right(self, params) -> bool:
        """Whether these parameters (None: the token kernels) give the reference's sums on
        the first set; a wrong one is reported and never chosen (the sweep goes on)."""
        one = dict(self.sets[0], y=self.y0.clone())
        got = (tokens_pair(one) if params is None else segments_pair(one, params))().float()
        err = (got - self.want).abs() - (6e-2 + 3e-2 * self.want.abs())
        if bool((err > 0).any()):
            print(f"WRONG {self.group} T={self.T} "
                  f"{'tokens' if params is None else params_text(params)}: "
                  f"max abs error {float((got - self.want).abs().max()):.3g}", flush=True)
            return False
        return True

    def time(self, stage: str, params) -> float:
        if params in self.times:
            return self.times[params]
        make = tokens_pair if params is None else (lambda s: segments_pair(s, params))
        t = self.timer([make(s) for s in self.sets], params) if self.right(params) else (
            float("inf"))
        self.times[params] = t
        self.rows.append(dict(group=self.group, tokens=self.T, stage=stage,
                              params="tokens" if params is None else params_text(params),
                              us=t * 1e6, pct_floor=100 * self.floor / t))
        return t

    def best(self, stage: str, current, candidates):
        """The fastest of current and the candidates timed before the deadline."""
        for p in candidates:
            if time.time() > self.deadline and min(self.times.values()) < float("inf"):
                break       # (past it, on only while nothing timed was right)
            self.time(stage, p)
        return min([current, *candidates], key=lambda p: self.times.get(p, float("inf")))


def params_text(p) -> str:
    return ", ".join(f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p)
                     if f.name != "path")


def _near(values: list[int], v: int) -> list[int]:
    """values other than v, nearest (by ratio) first."""
    return sorted((x for x in values if x != v), key=lambda x: max(x / v, v / x))


def sweep_point(pt: Point):
    """(tokens us, automatic us, best us, best params) after coordinate descent."""
    from loramux_kernels.lora.mixed import _plan
    t_tok = pt.time("tokens", None)
    s0 = pt.sets[0]
    plan = _plan(s0["x"].device, pt.T, s0["a"].shape[0], s0["offsets"], RANK, pt.K, None)
    best = dataclasses.replace(plan.params, programs=plan.programs,
                               split_k=plan.split_k, tpp=plan.tpp)
    auto = best
    t_auto = pt.time("auto", auto)
    rep = dataclasses.replace
    splits = [k for k in _near(SPLITS, best.split_k) if pt.K // k >= min(256, pt.K // 4)]
    best = pt.best("split_k", best, [rep(best, reduce=False)] + [
        rep(best, split_k=k, reduce=r) for k in splits for r in (True, False)])
    best = pt.best("tpp", best, [rep(best, tpp=v) for v in _near(TPPS, best.tpp)])
    best = pt.best("block_n", best, [rep(best, block_n=bn, tpp=max(1, best.tpp * 128 // bn))
                                     for bn in BLOCK_NS if bn != best.block_n])
    best = pt.best("programs", best, [rep(best, programs=p) for p in
                                      _near(PROGRAMS, best.programs)
                                      if p <= plan.tiles])
    best = pt.best("launch", best, [rep(best, warps=w, stages=st) for w, st in LAUNCH]
                   + [rep(best, block_k=bk) for bk in BLOCK_KS if bk != best.block_k])
    return t_tok, t_auto, pt.times[best], best


def table_rows(gpu: str, results) -> list[str]:
    """Rows for `gpu` from (shape class, tokens us, segments us, best params): TOKENS
    (kernels/lora/plan.py TABLE's entry) or the MIXED entry's MixedParams
    (kernels/lora/mixed.py PARAMS)."""
    lines = [f'    "{gpu}": {{']
    for cls, tok_us, seg_us, best in results:
        entry = ("TOKENS" if tok_us <= seg_us
                 else f"MixedParams({params_text(best)})")
        lines.append(f"        {cls!r}: {entry},  # tokens {tok_us:.1f} us, "
                     f"segments {seg_us:.1f} us")
    return lines + ["    },"]


def sweep(out: Path, budget: float, slots: int, bw: float, gpu: str,
          setup: Setup = Setup()) -> list[str]:
    """Every point within `budget` seconds; writes the CSV and the rows; returns them."""
    from loramux_kernels.lora.plan import shape_class
    start = time.time()
    points = [(T, g) for T in setup.tokens for g, _, _ in setup.groups]
    results, rows = [], []
    print("| group | T | floor us | tokens us (% floor) | auto us (%) | best us (%) | s |")
    print("|---|---|---|---|---|---|---|")
    for i, (T, group) in enumerate(points):
        deadline = start + budget * (i + 1) / len(points)
        pt = Point(setup, group, T, max(slots, ADAPTERS), bw, deadline)
        t_tok, t_auto, t_best, best = sweep_point(pt)
        results.append((shape_class(T, len(pt.N), pt.K, max(pt.N)), t_tok * 1e6,
                        t_best * 1e6, best))
        rows += pt.rows
        f = pt.floor
        print(f"| {group} | {T} | {f * 1e6:.1f} | {t_tok * 1e6:.1f} ({100 * f / t_tok:.0f}%) "
              f"| {t_auto * 1e6:.1f} ({100 * f / t_auto:.0f}%) "
              f"| {t_best * 1e6:.1f} ({100 * f / t_best:.0f}%) | {time.time() - start:.0f} |",
              flush=True)
        del pt
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "sweep_mixed.csv", rows)
    lines = table_rows(gpu, results)
    (out / "table_rows.txt").write_text("\n".join(lines) + "\n")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=180.0,
                    help="seconds for the whole sweep, shared by the points (default 180)")
    ap.add_argument("--slots", type=int, default=256, help="adapter pool slots (>= 64)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_lora_mixed needs a CUDA GPU", file=sys.stderr)
        return 2
    from loramux_kernels.lora.plan import gpu_key
    start = time.time()
    bw = copy_bandwidth(gib=1.0)
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    lines = sweep(args.out, args.budget, args.slots, bw, gpu_key(name) or name)
    print("\nrows of kernels/lora/plan.py TABLE (TOKENS) and kernels/lora/mixed.py PARAMS:")
    print("\n".join(lines))
    print(f"wrote {args.out / 'sweep_mixed.csv'} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
