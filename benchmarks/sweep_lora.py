"""Sweep the decode-path LoRA launch parameters (split-K of the shrink, programs per token
and slice of the expand) at the issue's small-batch target points, on Llama-3-8B shapes.

    python benchmarks/sweep_lora.py --out DIR

For every layer group (qkv, o, gate_up, down) and (tokens, distinct adapters) in
(1, 1), (16, 1), (64, 1), (64, 64), rank 16, bf16: each candidate (split_k, n_chunks) is
checked against the torch reference on the first buffer set, then timed as shrink + expand
with CUDA graphs over rotating buffer sets (benchmarks/common.py). Prints, per point, the
default choice (kernels/lora/token.py) and the best candidate with their times and
% of the floor; writes sweep.csv with every candidate. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_kernels import (BF16, Case, expand_floor_bytes, layer_groups,  # noqa: E402
                                      make_set, rotating_sets, shrink_floor_bytes)
from benchmarks.common import copy_bandwidth, floor_seconds, time_graph, write_csv  # noqa: E402

POINTS = [(1, 1), (16, 1), (64, 1), (64, 64)]
SPLITS = [1, 2, 4, 8, 16, 28, 32]
CHUNKS = [1, 2, 4, 8, 16, 32, 64]


def candidates(K: int, n_tiles: int) -> list[tuple[int, int]]:
    """(split_k, n_chunks) pairs: K chunks of at least 128, at most one program per tile."""
    splits = [s for s in SPLITS if K // s >= 128]
    chunks = sorted({min(c, n_tiles) for c in CHUNKS})
    return [(s, c) for s in splits for c in chunks]


def run_pair(s, split_k: int | None, n_chunks: int | None):
    from loramux_kernels.lora.token import lora_expand_tokens, lora_shrink_tokens
    from loramux_kernels.lora.token import _offsets
    offs = _offsets(s["offsets"])
    S = len(s["offsets"]) - 1

    def fn():
        hp = lora_shrink_tokens(s["x"], s["a"], s["meta"], s["ranks"], split_k=split_k)
        return lora_expand_tokens(hp, s["b"], s["y"], s["meta"], offs, S, s["ranks"],
                                  n_chunks=n_chunks)
    return fn


def check(s, split_k: int, n_chunks: int) -> None:
    from loramux_kernels.lora.reference import add_lora_ref
    y0 = s["y"].clone()
    got = run_pair(dict(s, y=y0), split_k, n_chunks)()
    want = add_lora_ref(s["y"].clone(), s["x"], s["a"], s["b"], s["ts"], s["offsets"])
    torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=3e-2)


def sweep_point(group: str, T: int, L: int, bw: float) -> list[dict]:
    from loramux_kernels.lora.token import _block_r, _tile, default_n_chunks, default_split_k
    _, K, N = next(g for g in layer_groups() if g[0] == group)
    r, S = 16, len(N)
    case = Case(group, r, T, L, "contiguous")
    per_set = T * K * BF16 + L * S * r * K * BF16 + L * sum(N) * r * BF16 + T * sum(N) * BF16
    sets = [make_set(case, seed) for seed in range(rotating_sets(per_set))]
    n_tiles = -(-max(N) // _tile(_block_r(r)))
    floor = floor_seconds(shrink_floor_bytes(T, K, S, r, L) + expand_floor_bytes(T, N, r, L),
                          bw, 2)
    default = (default_split_k(T, S, K), default_n_chunks(T, S, n_tiles))
    rows = []
    for split_k, n_chunks in candidates(K, n_tiles):
        check(sets[0], split_k, n_chunks)
        t = time_graph([run_pair(s, split_k, n_chunks) for s in sets])
        rows.append(dict(group=group, tokens=T, adapters=L, split_k=split_k,
                         n_chunks=n_chunks, us=t * 1e6, pct_floor=100 * floor / t,
                         default=(split_k, n_chunks) == default))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    print("| group | T | L | default (split, chunks) us % | best (split, chunks) us % |")
    for group, _, _ in layer_groups():
        for T, L in POINTS:
            pts = sweep_point(group, T, L, bw)
            rows += pts
            d = next((p for p in pts if p["default"]), None)
            b = min(pts, key=lambda p: p["us"])
            dtxt = (f"({d['split_k']}, {d['n_chunks']}) {d['us']:.1f} {d['pct_floor']:.0f}%"
                    if d else "not in grid")
            print(f"| {group} | {T} | {L} | {dtxt} | ({b['split_k']}, {b['n_chunks']}) "
                  f"{b['us']:.1f} {b['pct_floor']:.0f}% |", flush=True)
    write_csv(args.out / "sweep.csv", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
