"""Stalls of whole decode steps on the host, and the garbage collections inside them (CPU).

    python benchmarks/experiments/bench_step_pauses.py [--batch 256] [--rounds 8] [--steps 32]

A real Engine on a tiny model (tests/support/tiny.py, async scheduling on as on one CUDA
device, the CPU's eager forward pass), driven the way benchmarks/bench_decode.py drives
it: each round adds `--batch` requests (4 adapters and the base round-robin), steps until
all decode, four more steps, then times `--steps` back-to-back `Engine.step()` calls
(wall and this thread's CPU time), then aborts them all. Every collection of CPython's
cyclic collector is timed (gc.callbacks: generation, duration, objects collected) and
charged to the step it fell in; a step whose batch took new KV blocks (all sequences
cross a block boundary together) is counted apart.

Each heap setting runs in a fresh interpreter: "default" (what a process gets),
"frozen" (loramux_core.gc_heap.freeze_heap after the engine is built and its adapters
loaded, as the engine server does after its warm-up).
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed
from benchmarks.gc_clock import GcClock  # noqa: E402

NUM_ADAPTERS = 4


def build(root: Path, batch: int):
    from loramux_engine import Engine, EngineConfig
    from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

    model = make_model(root / "model", TinySpec())
    eng = Engine(EngineConfig(model=str(model), max_num_seqs=batch, max_loras=NUM_ADAPTERS,
                              num_kv_blocks=batch * 16, max_num_batched_tokens=8192,
                              enforce_eager=True, async_scheduling=True, cpu_threads=1))
    for i in range(NUM_ADAPTERS):
        make_adapter(root / f"a{i}", model, AdapterSpec(seed=10 + i))
        eng.add_adapter(f"a{i}", root / f"a{i}")
    return eng


def run_round(eng, rnd: int, args, rng: random.Random) -> list[dict]:
    """One bench_decode point: add, prefill, warm, time `args.steps` steps, abort."""
    from loramux_engine import SamplingParams

    names = [None] + [f"a{i}" for i in range(NUM_ADAPTERS)]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(3, 380) for _ in range(args.prompt_len)]
        eng.add_request(f"r{rnd}-{i}", prompt, params, adapter=names[i % len(names)])
    sched = eng.scheduler
    while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
        eng.step()
    for _ in range(4):
        eng.step()
    steps = []
    for _ in range(args.steps):
        free = eng.kv.num_free_blocks
        t0, c0 = time.perf_counter(), time.thread_time()
        eng.step()
        t1, c1 = time.perf_counter(), time.thread_time()
        steps.append({"t0": t0, "wall": t1 - t0, "cpu": c1 - c0,
                      "boundary": eng.kv.num_free_blocks < free})
    for r in list(sched.running) + list(sched.waiting):
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return steps


def one(args) -> dict:
    """One heap setting in this interpreter; the numbers as a dict."""
    from loramux_core.gc_heap import freeze_heap

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        eng = build(Path(tmp), args.batch)
        t0 = time.thread_time()
        gc.collect()
        full_ms = (time.thread_time() - t0) * 1e3  # CPU time: the machine may be shared
        tracked = len(gc.get_objects())
        frozen = freeze_heap() if args.one == "frozen" else 0
        clock = GcClock()
        steps = []
        for rnd in range(args.rounds):
            steps += run_round(eng, rnd, args, rng)
        eng.close()
    for s in steps:
        s["gc"] = [(e.seconds, e.generation, e.collected)
                   for e in clock.between(s["t0"], s["t0"] + s["wall"])]
    gen2 = [e.seconds * 1e3 for e in clock.events if e.generation == 2]
    wall = [s["wall"] * 1e3 for s in steps]
    q = statistics.quantiles(wall, n=100, method="inclusive")
    in_steps = [p for s in steps for p in s["gc"]]
    return {
        "heap": args.one, "tracked": tracked, "frozen": frozen, "full_collect_ms": full_ms,
        "steps": len(steps), "p50": statistics.median(wall), "p99": q[98], "max": max(wall),
        "cpu_p50": statistics.median(s["cpu"] * 1e3 for s in steps),
        "cpu_max": max(s["cpu"] * 1e3 for s in steps),
        "boundary_cpu_p50": statistics.median([s["cpu"] * 1e3 for s in steps if s["boundary"]]
                                          or [float("nan")]),
        "gen2_n": len(gen2), "gen2_max": max(gen2, default=0.0),
        "gen2_in_steps": sum(g == 2 for _, g, _ in in_steps),
        "gc_max_in_steps": max((dt * 1e3 for dt, _, _ in in_steps), default=0.0),
        "gc_ms_per_step": sum(dt for dt, _, _ in in_steps) * 1e3 / len(steps),
        "collected_per_step": sum(n for _, _, n in in_steps) / len(steps),
    }


COLS = [("heap", "{}"), ("tracked", "{:,}"), ("frozen", "{:,}"), ("full_collect_ms", "{:.1f}"),
        ("steps", "{}"), ("p50", "{:.2f}"), ("p99", "{:.2f}"), ("max", "{:.2f}"),
        ("cpu_p50", "{:.2f}"), ("cpu_max", "{:.2f}"), ("boundary_cpu_p50", "{:.2f}"),
        ("gen2_n", "{}"), ("gen2_max", "{:.1f}"), ("gen2_in_steps", "{}"),
        ("gc_max_in_steps", "{:.2f}"), ("gc_ms_per_step", "{:.3f}"),
        ("collected_per_step", "{:.1f}")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--heaps", default="default,frozen")
    ap.add_argument("--one", choices=("default", "frozen"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(args)))
        return
    rows = []
    for heap in args.heaps.split(","):
        argv = [sys.executable, __file__, "--one", heap, "--batch", str(args.batch),
                "--rounds", str(args.rounds), "--steps", str(args.steps),
                "--prompt-len", str(args.prompt_len)]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"batch {args.batch}, {args.rounds} rounds of {args.steps} timed steps; ms; "
          "gen2 = full collections over the whole run")
    print("| " + " | ".join(c for c, _ in COLS) + " |")
    print("|" + "---|" * len(COLS))
    for r in rows:
        print("| " + " | ".join(f.format(r[c]) for c, f in COLS) + " |")


if __name__ == "__main__":
    main()
