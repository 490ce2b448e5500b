"""Sweep the mixed-adapter decode kernels' launch parameters (kernels/lora_mixed_triton.py)
against the token kernels at 64, 128 and 256 tokens over 64 adapters (rank 16, bf16,
Llama-3-8B layer groups), and print the TABLE rows they give.

    python benchmarks/sweep_lora_mixed.py --out DIR [--full]

Per (group, tokens): the token kernels (kernels/lora_token_triton.py) and the segment
kernels at the automatic parameters; then, timing shrink + expand together (so that partial
sums left to the expand are paid for), the shrink over (split_k, reduce) (--full: and
block_k), the expand over (block_n, tpp) with the best shrink, then (warps, stages) and
block_k 128; the best is checked against the torch reference. About 3 minutes on an H100
with an empty Triton cache. Floors as bench_kernels (PERF.md), from the copy
bandwidth measured in the same run. Writes sweep_mixed.csv to DIR; prints a table and the
rows to paste into TABLE (path "tokens" where the token kernels were faster). Needs CUDA.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_kernels import (BF16, Case, expand_floor_bytes, layer_groups,  # noqa: E402
                                      make_set, shrink_floor_bytes)
from benchmarks.common import (copy_bandwidth, floor_seconds, rotating_sets,  # noqa: E402
                               time_graph)

POINTS = [(64, 64), (128, 64), (256, 64)]
SPLITS = [1, 2, 4, 8, 16]
BLOCK_KS = [128, 256]
BLOCK_NS = [64, 128, 256]
TPPS = [1, 2, 4, 8]
LAUNCH = [(4, 2), (4, 3), (8, 3)]


def tokens_pair(s):
    from kernels.lora_token_triton import lora_expand_tokens, lora_shrink_tokens
    from kernels.lora_triton import _offsets
    offs, S = _offsets(s["offsets"]), len(s["offsets"]) - 1

    def fn():
        hp = lora_shrink_tokens(s["x"], s["a"], s["meta"], s["ranks"])
        return lora_expand_tokens(hp, s["b"], s["y"], s["meta"], offs, S, s["ranks"])
    return fn


def segments_pair(s, params):
    from kernels.lora_mixed_triton import add_lora_mixed
    return lambda: add_lora_mixed(s["y"], s["x"], s["a"], s["b"], s["meta"], s["offsets"],
                                  s["ranks"], params)


def check(s, params) -> None:
    from kernels.lora_ref import add_lora_ref
    got = segments_pair(dict(s, y=s["y"].clone()), params)()
    want = add_lora_ref(s["y"].clone(), s["x"], s["a"], s["b"], s["ts"], s["offsets"])
    torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=3e-2)


class Point:
    """One (group, tokens, adapters) point: its buffer sets, floor and timings so far."""

    def __init__(self, group: str, T: int, L: int, bw: float):
        _, K, N = next(g for g in layer_groups() if g[0] == group)
        self.group, self.T, self.L, self.K, self.N = group, T, L, K, N
        r, S = 16, len(N)
        per_set = T * K * BF16 + L * S * r * K * BF16 + L * sum(N) * r * BF16 + T * sum(N) * BF16
        case = Case(group, r, T, L, "random")
        self.sets = [make_set(case, seed) for seed in range(rotating_sets(per_set))]
        self.floor = floor_seconds(shrink_floor_bytes(T, K, S, r, L)
                                   + expand_floor_bytes(T, N, r, L), bw, 2)
        self.rows: list[dict] = []

    def time(self, stage: str, params) -> float:
        if params is None:
            t = time_graph([tokens_pair(s) for s in self.sets])
        else:
            t = time_graph([segments_pair(s, params) for s in self.sets])
        self.rows.append(dict(group=self.group, tokens=self.T, adapters=self.L, stage=stage,
                              params="tokens" if params is None else _params_text(params),
                              us=t * 1e6, pct_floor=100 * self.floor / t))
        return t

    def best(self, stage: str, candidates):
        times = {p: self.time(stage, p) for p in candidates}
        return min(times, key=times.get)


def _params_text(p) -> str:
    return ", ".join(f"{f.name}={getattr(p, f.name)!r}" for f in dataclasses.fields(p)
                     if f.name != "path")


def sweep_point(pt: Point, full: bool):
    """Coordinate descent from the automatic parameters; returns (tokens us, auto us,
    best us, best params)."""
    from kernels.lora_mixed_triton import MixedParams
    t_tok = pt.time("tokens", None)
    base = MixedParams()
    t_auto = pt.time("auto", base)
    splits = [k for k in SPLITS if pt.K // k >= 256]
    shrink = [dataclasses.replace(base, split_k=k, reduce=red, block_k=bk)
              for k in splits for red in ([True, False] if k > 1 else [True])
              for bk in (BLOCK_KS if full else BLOCK_KS[-1:])]
    best = pt.best("shrink", shrink)
    widest = max(pt.N)
    expand = [dataclasses.replace(best, block_n=bn, tpp=tpp) for bn in BLOCK_NS
              for tpp in TPPS if tpp == 1 or tpp * bn < widest]
    best = pt.best("expand", expand)
    best = pt.best("launch", [dataclasses.replace(best, warps=w, stages=st)
                              for w, st in LAUNCH] + [dataclasses.replace(best, block_k=128)])
    check(pt.sets[0], best)
    return t_tok, t_auto, pt.time("best", best), best


def table_rows(gpu: str, results) -> list[str]:
    """TABLE rows for `gpu` from (shape class, tokens us, segments us, best params)."""
    lines = [f'    "{gpu}": {{']
    for cls, tok_us, seg_us, best in results:
        entry = ('MixedParams(path="tokens")' if tok_us <= seg_us
                 else f"MixedParams({_params_text(best)})")
        lines.append(f"        {cls!r}: {entry},  # tokens {tok_us:.1f} us, "
                     f"segments {seg_us:.1f} us")
    return lines + ["    },"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--full", action="store_true", help="block_k 128 and 256 for every "
                    "shrink candidate (longer)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_lora_mixed needs a CUDA GPU", file=sys.stderr)
        return 2
    from kernels.lora_mixed_triton import gpu_key, shape_class
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    results, rows = [], []
    print("| group | T | L | floor us | tokens us (% floor) | auto us (%) | best us (%) |")
    print("|---|---|---|---|---|---|---|")
    for group, _, _ in layer_groups():
        for T, L in POINTS:
            pt = Point(group, T, L, bw)
            t_tok, t_auto, t_best, best = sweep_point(pt, args.full)
            results.append((shape_class(T, len(pt.N), pt.K, max(pt.N)), t_tok * 1e6,
                            t_best * 1e6, best))
            rows += pt.rows
            f = pt.floor
            print(f"| {group} | {T} | {L} | {f * 1e6:.1f} | {t_tok * 1e6:.1f} "
                  f"({100 * f / t_tok:.0f}%) | {t_auto * 1e6:.1f} ({100 * f / t_auto:.0f}%) "
                  f"| {t_best * 1e6:.1f} ({100 * f / t_best:.0f}%) | "
                  f"[{time.time() - start:.0f} s]", flush=True)
            del pt
            torch.cuda.empty_cache()
    with open(args.out / "sweep_mixed.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    lines = table_rows(gpu_key(name) or name, results)
    (args.out / "table_rows.txt").write_text("\n".join(lines) + "\n")
    print("\nTABLE rows (kernels/lora_mixed_triton.py):")
    print("\n".join(lines))
    print(f"wrote {args.out / 'sweep_mixed.csv'} in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
