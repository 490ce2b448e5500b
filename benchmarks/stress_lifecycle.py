"""The long run of the adapter lifecycle stress (tests/support/lifecycle_stress.py) on the
CPU: `--ops` random operations in runs of `--run-ops`, each run on a fresh engine with the
next configuration of CONFIGS and seed `--seed` + run index, every run checked after every
operation and back to the idle baseline at its end.

    python -m benchmarks.adapters stress --out DIR --ops 100000
    python -m benchmarks.adapters stress --out DIR --seed 1234 --ops 2000  # replay a failed run

Prints a table per configuration at the end; the log (one line per run) goes to --out.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
if "TRITON_INTERPRET" not in os.environ:  # no GPU needed: kernels run interpreted
    os.environ["TRITON_INTERPRET"] = "1"

from tests.support.lifecycle_stress import LifecycleStress, StressConfig, references  # noqa: E402
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model  # noqa: E402

CONFIGS = (
    StressConfig(max_loras=2, max_cpu_loras=2),
    StressConfig(max_loras=1, max_cpu_loras=1, async_scheduling=True),
    StressConfig(max_loras=2, max_cpu_loras=3, async_scheduling=True),
    StressConfig(max_loras=1, max_cpu_loras=4),
    StressConfig(max_loras=3, max_cpu_loras=3, names=tuple("abcdefgh")),
)
MAX_TOKENS = 4


def build_files(root: Path) -> tuple[Path, dict[str, Path]]:
    model = make_model(root / "model", TinySpec())
    weights = {f"w{i}": make_adapter(root / f"w{i}", model,
                                     AdapterSpec(r=4 * (1 + i % 3), lora_alpha=16, seed=80 + i))
               for i in range(5)}
    return model, weights


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ops", type=int, default=100_000, help="operations in all")
    p.add_argument("--run-ops", type=int, default=2000, help="operations per engine")
    p.add_argument("--seed", type=int, default=None, help="first run's seed (default: random)")
    p.add_argument("--out", default=None, help="directory for the log")
    args = p.parse_args(argv)
    seed = random.randrange(1 << 30) if args.seed is None else args.seed
    out = Path(args.out or tempfile.mkdtemp(prefix="stress-lifecycle-"))
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "runs.log", "a")
    print(f"seed {seed}, {args.ops} ops in runs of {args.run_ops}, log {out / 'runs.log'}",
          flush=True)
    model, weights = build_files(Path(tempfile.mkdtemp(prefix="stress-files-")))
    refs = references(model, weights, MAX_TOKENS)
    rows: dict[int, list] = {}
    done, run_i, start = 0, 0, time.monotonic()
    while done < args.ops:
        k = run_i % len(CONFIGS)
        cfg, ops, run_seed = CONFIGS[k], min(args.run_ops, args.ops - done), seed + run_i
        t0 = time.monotonic()
        stress = LifecycleStress(cfg, model, weights, refs, run_seed)
        try:
            st = stress.run(ops)
        finally:
            stress.close()
        dt = time.monotonic() - t0
        line = (f"run {run_i} seed {run_seed} config {k} ops {ops} steps {st.steps} "
                f"finished {st.finished} aborted {st.aborted} refused {st.refused} "
                f"max_wait {st.max_wait} max_wait/bound {st.max_wait_share:.2f} "
                f"tiers {sorted(stress.tiers_seen)} {dt:.1f}s")
        print(line, flush=True)
        log.write(line + "\n")
        log.flush()
        r = rows.setdefault(k, [0, 0, 0, 0, 0.0, 0.0])
        r[0] += ops
        r[1] += st.steps
        r[2] += st.finished
        r[3] = max(r[3], st.max_wait)
        r[4] = max(r[4], st.max_wait_share)
        r[5] += dt
        done += ops
        run_i += 1
    total = time.monotonic() - start
    print(f"\n{'config':<58} {'ops':>7} {'steps':>7} {'finished':>8} {'max wait':>8} "
          f"{'wait/bound':>10} {'time s':>7}")
    for k, (ops, steps, fin, mw, share, dt) in sorted(rows.items()):
        c = CONFIGS[k]
        name = (f"max_loras={c.max_loras} max_cpu_loras={c.max_cpu_loras} "
                f"async={c.async_scheduling} names={len(c.names)}")
        print(f"{name:<58} {ops:>7} {steps:>7} {fin:>8} {mw:>8} {share:>10.2f} {dt:>7.0f}")
    print(f"all checks passed: {done} ops in {run_i} runs, {total:.0f} s (seed {seed})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
