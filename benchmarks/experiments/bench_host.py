"""Host overhead of one decode step at a large batch, measured on the CPU (no GPU needed).

    python benchmarks/experiments/bench_host.py [--batch 256] [--steps 50] [--profile]

A real Engine on a tiny model is driven until `--batch` requests are all decoding; then,
per step, the host phases that run serially with a GPU step are timed separately:

    schedule   loramux_engine.scheduler.schedule()
    fill       the CUDA graph path's static-input fill (DecodeStaging.fill, CPU buffers)
    prepare    the eager path's ModelRunner.prepare_inputs (for comparison; not in total)
    update     loramux_engine.scheduler.update(out, sampled) with fabricated sampled tokens
    plan       tensor parallelism, rank 0: the step plan for the workers (PlanTracker.plan
               and encode_step), before it is sent
    worker     tensor parallelism, a worker from the plan's receipt to its upload:
               decode_step, RequestMirror.apply and the fill from the mirror's output

"total" = schedule + fill + update (what a graph-replayed decode step costs the host).
Under tensor parallelism rank 0 sends the plan, then fills; a worker receives it (gloo:
benchmarks/experiments/bench_plan_channel.py), then runs `worker`; so the worker starts its replay
about latency + worker - fill after rank 0 (the rank skew that rank 0 waits out in the
step's first all-reduce).
Modes: "base" (no adapter) and "lora" (4 adapters spread round-robin over the batch).
`--profile` runs the lora mode under cProfile and prints the top functions.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed
from loramux_engine import Engine, EngineConfig, SamplingParams  # noqa: E402
from loramux_engine.cuda_graph import DecodeStaging  # noqa: E402
from loramux_engine.distributed.mirror import RequestMirror  # noqa: E402
from loramux_engine.distributed.plan import decode_step, encode_step  # noqa: E402
from loramux_engine.distributed.tracker import PlanTracker  # noqa: E402
from loramux_engine.scheduler import Sampled  # noqa: E402
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model  # noqa: E402

NUM_ADAPTERS = 4
PROMPT_LEN = 20
TOKEN = 65  # a fabricated sampled token (not EOS; ignore_eos anyway)


def build_engine(root: Path, batch: int, adapters: bool) -> Engine:
    model = make_model(root / "model", TinySpec())
    eng = Engine(EngineConfig(model=str(model), max_num_seqs=batch, max_loras=NUM_ADAPTERS,
                              num_kv_blocks=batch * 64, max_num_batched_tokens=8192,
                              enforce_eager=True))
    names = [None]
    if adapters:
        names = []
        for i in range(NUM_ADAPTERS):
            path = root / f"a{i}"
            if not path.exists():
                make_adapter(path, model, AdapterSpec(seed=10 + i))
            eng.add_adapter(f"a{i}", path)
            names.append(f"a{i}")
    params = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)
    for i in range(batch):
        prompt = [(i * 7 + j) % 300 + 3 for j in range(PROMPT_LEN)]  # distinct prompts
        eng.add_request(f"r{i}", prompt, params, adapter=names[i % len(names)])
    while len(eng.scheduler.running) < batch or any(
            r.num_tokens - r.num_computed_tokens > 1 for r in eng.scheduler.running):
        eng.step()
    return eng


def time_steps(eng: Engine, steps: int, staging: DecodeStaging,
               tp: "TPSide") -> dict[str, list[float]]:
    sched, runner = eng.scheduler, eng.runner
    times: dict[str, list[float]] = {k: [] for k in ("schedule", "fill", "prepare", "update",
                                                      "plan", "worker")}
    clock = time.perf_counter
    for _ in range(steps):
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        staging.fill(out.scheduled, staging.max_batch)
        t2 = clock()
        runner.prepare_inputs(out)
        t3 = clock()
        sampled = {s.request.request_id: Sampled(TOKEN, -0.5, None) for s in out.scheduled}
        t4 = clock()
        sched.update(out, sampled)
        t5 = clock()
        payload = encode_step(tp.tracker.plan(out, [], True))
        t6 = clock()
        mirrored = tp.mirror.apply(decode_step(payload))
        tp.staging.fill(mirrored.scheduled, tp.staging.max_batch)
        t7 = clock()
        assert len(out.scheduled) == staging.max_batch and all(
            s.num_new_tokens == 1 for s in out.scheduled), "not a full decode step"
        for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t5 - t4, t6 - t5, t7 - t6)):
            times[k].append(dt * 1e6)
    return times


class TPSide:
    """Rank 0's plan tracker and one worker's mirror and staging, fed every step."""

    def __init__(self, eng: Engine, batch: int):
        self.tracker, self.mirror = PlanTracker(), RequestMirror()
        self.staging = make_staging(eng, batch)


def make_staging(eng: Engine, batch: int) -> DecodeStaging:
    """The graph path's staging buffers, on the CPU (the fill is host work either way)."""
    bs, max_len = eng.config.block_size, eng.max_model_len
    return DecodeStaging(batch, -(-max_len // bs), bs, max_len, eng.runner.device)


def run_mode(root: Path, batch: int, steps: int, adapters: bool) -> dict[str, float]:
    eng = build_engine(root, batch, adapters)
    staging = make_staging(eng, batch)
    tp = TPSide(eng, batch)
    time_steps(eng, 5, staging, tp)  # warm up (the first plan carries whole prompts)
    t = time_steps(eng, steps, staging, tp)
    med = {k: statistics.median(v) for k, v in t.items()}
    med["total"] = med["schedule"] + med["fill"] + med["update"]
    eng.close()
    return med


def profile(root: Path, batch: int, steps: int) -> None:
    eng = build_engine(root, batch, True)
    staging = make_staging(eng, batch)
    tp = TPSide(eng, batch)
    time_steps(eng, 5, staging, tp)
    prof = cProfile.Profile()
    prof.enable()
    time_steps(eng, steps, staging, tp)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.profile:
            profile(root, args.batch, args.steps)
            return
        rows = {mode: run_mode(root, args.batch, args.steps, mode == "lora")
                for mode in ("base", "lora")}
    cols = ("schedule", "fill", "update", "total", "prepare", "plan", "worker")
    print(f"batch {args.batch}, {args.steps} steps, median µs per step")
    print("| mode | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for mode, med in rows.items():
        print(f"| {mode} | " + " | ".join(f"{med[c]:,.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main()
