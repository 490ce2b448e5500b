"""The LoRA planner's grid measured on this GPU: every kernel form on every cell of
kernels/lora/plan_table.py, and the rows that table takes from it.

    python -m benchmarks.kernels lora --planner --out DIR [--ranks 8,16,32,64,128]
        [--groups qkv,o] [--budget SECONDS] [--source NAME] [--tiny]

Per row of the table (projection group, rank bucket, one adapter or many) and token
bucket (1, 16, 32, 64, 128, 256): the token kernels, the mixed segment tiles and the tile
list (kernels/lora/launch.py add_lora_on), each checked against the torch reference on
fresh random A, B, x and y, then timed in CUDA graphs over rotating buffer sets
(bench_peers.py's sets and timing); "many" is T/4 adapters with 4 rows each in random
order (fewer rows per adapter take the token kernels by the `spread` rule, not the
table). The fastest form fills the cell. Rows are measured one adapter first, from the
highest rank down, while --budget lasts (both files are rewritten after every row); a
row not reached keeps the current table's.

Writes DIR/plan.csv (every form's time and the floor) and DIR/plan_table.py: the rows to
paste under this GPU's key in kernels/lora/plan_table.py, each naming NAME/plan.csv
(keep DIR as benchmarks/results/NAME). Prints a short table: per row the forms chosen and
at 256 tokens the best time against the current table's form. --tiny: the CPU under
Triton's interpreter, tiny shapes and token counts (a check of the script, not a
measurement).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_kernels import (expand_floor_bytes, layer_groups,  # noqa: E402
                                      shrink_floor_bytes)
from benchmarks.bench_peers import (TINY_GROUPS, Case, _device_name, agrees,  # noqa: E402
                                    copy_bandwidth, make_set, time_calls)

TINY_TOKENS = (1, 4, 8, 12, 16, 20)    # stand-ins for the six token buckets (--tiny)
ROWS_PER_ADAPTER = 4                   # "many": the spread rule's threshold (plan.py)


def time_forms(case: Case, bw: float, device: torch.device) -> tuple[float, dict]:
    """(the floor in us, {form: us}) for every form (inf: it disagrees with the
    reference)."""
    from benchmarks.common import floor_seconds, rotating_sets
    from loramux_kernels.lora import plan
    from loramux_kernels.lora.launch import add_lora_on
    L, S, r, T, K, N = case.adapters, len(case.N), case.rank, case.tokens, case.K, case.N
    per_set = 2 * (T * K + L * S * r * K + L * sum(N) * r + T * sum(N))
    sets = [make_set(case, seed, device)
            for seed in range(rotating_sets(per_set) if device.type == "cuda" else 1)]
    nbytes = shrink_floor_bytes(T, K, S, r, L) + expand_floor_bytes(T, N, r, L)
    out = {}
    for form in plan.FORMS:
        def call(s, form=form):
            return lambda: add_lora_on(form, s["y"], s["x"], s["a"], s["b"], s["meta"],
                                       s["offsets"], s["ranks"], uniform=L == 1)
        ok, _ = agrees(call, sets[0])
        out[form] = time_calls([call(s) for s in sets], device) * 1e6 if ok else float("inf")
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return floor_seconds(nbytes, bw, 2) * 1e6, out


def measure_row(key: tuple[str, int, str], shape, tokens, bw, device) -> list[dict]:
    """The cells of one table row, every form timed; "many" at one token is one adapter."""
    (group, rank, adapters), (_, K, N) = key, shape
    cells = []
    for T in tokens:
        L = 1 if adapters == "one" else max(1, T // ROWS_PER_ADAPTER)
        floor, us = time_forms(Case(group, K, N, rank, T, L, "random"), bw, device)
        cells.append(dict(group=group, rank=rank, adapters=adapters, T=T, L=L,
                          floor_us=floor, us=us))
    return cells


def best(cell: dict) -> str:
    from loramux_kernels.lora import plan
    return min(plan.FORMS, key=lambda f: cell["us"][f])


def table_lines(measured: dict, current: dict, source: str, device_name: str,
                gpu: str) -> list[str]:
    """A `gpu` = {...} block for kernels/lora/plan_table.py with every key of `current`:
    measured rows name `source`, the others keep theirs."""
    lines = [f"# measured on {device_name} ({datetime.date.today()}): paste into "
             f"kernels/lora/plan_table.py and name it in TABLE", f"{gpu} = {{"]
    for key, (forms, src) in current.items():
        if key in measured:
            forms, src = tuple(best(c) for c in measured[key]), source
        cells = ", ".join(f'"{f}"' for f in forms)
        lines.append(f"    {key!r}: (({cells}), {src!r}),")
    return lines + ["}"]


def summary(measured: dict, current: dict) -> list[str]:
    out = [f"{'group':8} {'r':>4} {'adapters':8} forms by token bucket      last: best us "
           f"(current form's us)"]
    for key, cells in measured.items():
        last, was = cells[-1], current[key][0][-1]
        out.append(f"{key[0]:8} {key[1]:4} {key[2]:8} {' '.join(best(c)[:5] for c in cells):35}"
                   f" {best(last)} {last['us'][best(last)]:.1f} ({was} {last['us'][was]:.1f})")
    return out


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="the CPU, Triton's interpreter")
    p.add_argument("--ranks", default="128,64,32,16,8", help="rank buckets, measured in order")
    p.add_argument("--groups", default=None, help="projection groups (default: all four)")
    p.add_argument("--budget", type=float, default=240.0, help="seconds of measuring")
    p.add_argument("--source", default=None,
                   help="the results folder's name the rows cite (default DATE-GPU)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tiny:   # before any kernel module is imported: Triton decides at decoration
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("the planner grid measures on a CUDA GPU; --tiny checks it on the CPU",
              file=sys.stderr)
        return 2
    from loramux_kernels.lora import plan
    device = torch.device("cpu" if args.tiny else "cuda")
    name = _device_name(device)
    gpu = plan.device_facts(device)[0]
    current = plan.TABLE.get(gpu, plan.DEFAULT)
    label = gpu or ("cpu" if args.tiny else "GPU")
    run = args.source or f"{datetime.date.today()}-{label.lower()}"
    source = f"{run}/plan.csv"
    shapes = {g[0]: g for g in (TINY_GROUPS if args.tiny else layer_groups())}
    groups = args.groups.split(",") if args.groups else list(shapes)
    tokens = TINY_TOKENS if args.tiny else plan.TOKEN_BUCKETS
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {name}", flush=True)
    measured, deadline = {}, time.monotonic() + args.budget
    # one adapter first: where the token kernels' re-reads cost most (module docstring)
    keys = [(g, int(r), n) for n in ("one", "many") for r in args.ranks.split(",")
            for g in groups]
    for key in keys:
        if time.monotonic() > deadline:
            print(f"budget spent: {key} and the rows after it keep the current table's")
            break
        measured[key] = measure_row(key, shapes[key[0]], tokens, bw, device)
        print(f"{key[0]:8} r={key[1]:<3} {key[2]:4} "
              + " ".join(f"{c['T']}:{best(c)}" for c in measured[key]), flush=True)
        # after every row: a run cut off by a time limit keeps what it measured
        write(args.out, measured, table_lines(measured, current, source, name, label.upper()))
    print(f"wrote {args.out / 'plan.csv'} and {args.out / 'plan_table.py'}")
    print("\n".join(summary(measured, current)))
    return 0


def write(out: Path, measured: dict, lines: list[str]) -> None:
    from loramux_kernels.lora import plan
    out.mkdir(parents=True, exist_ok=True)
    cols = ["group", "rank", "adapters", "T", "L", "floor_us"]
    rows = [",".join([*(str(c[k]) for k in cols), *(f"{c['us'][f]:.2f}" for f in plan.FORMS)])
            for cells in measured.values() for c in cells]
    cols += [f"{f}_us" for f in plan.FORMS]
    (out / "plan.csv").write_text("\n".join([",".join(cols), *rows]) + "\n")
    (out / "plan_table.py").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
