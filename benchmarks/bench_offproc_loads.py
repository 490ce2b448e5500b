"""What a cold adapter load costs the engine process: adapters read on its own threads
(`--adapter-loaders 0`) against reads in loader processes (engine/adapters/loader_pool.py),
in one run, on the same engine build.

    python -m benchmarks.adapters offproc --out DIR                 # CPU, ~2 min
    python -m benchmarks.adapters offproc --out DIR --device cuda --width 8b \
        --layers 32 --rank 16 --batch 64 --loads 64 --readers 16 --engine-cpus 0

The engine process is pinned to `--engine-cpus` cores (default 1; 0: no pinning) and
the loader processes to the others, as an engine process on a GPU host has its cores:
reads on its own threads then take time from its step thread; reads in loaders do not.
For each path (`--paths`, in that order: repeated to see the noise; "4u": 4 loaders with host
buffers page-locked unpopulated, as before their pages were faulted in first), an engine (random
weights):

1. reads LOADS new adapters at once on READERS threads (Engine.read_adapter, as the
   engine server reads AddAdapter commands) while idle, then registers them: CPU
   milliseconds per load of the engine process and of the loader processes, loads/s;
2. decodes BATCH base requests, STEPS steps alone, then while LOADS other adapters are
   read at once (the "AddAdapter storm"), until every read has landed: step times
   (median, p90, max) alone and during the loads (the step thread's stall is the
   difference), loads/s while decoding.

The model has Llama-3-8B's widths (`--width 8b`) or half of them (`half`, the default:
a CPU decode step of tens of ms), `--layers` layers and a 1,024-token vocabulary;
adapters are rank `--rank` on all seven projections (what is read, hashed and converted
grows with width x layers x rank: at `8b`, 32 layers and rank 16, the 84 MB of a
Llama-3-8B adapter). Logs and a JSON summary go to --out.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import TeeLog  # noqa: E402
from benchmarks.llama8b import LLAMA3_8B, write_adapter, write_model_dir  # noqa: E402
from benchmarks.serving.counters import cpu_seconds  # noqa: E402
from benchmarks.serving.files import link_adapters  # noqa: E402

MAX_TOKENS = 4096   # per decoding request: more than the run's steps


def children_cpu(pids) -> float:
    """CPU seconds (user + system) the processes `pids` have used so far."""
    return sum(cpu_seconds(p) or 0.0 for p in pids)


WIDTHS = {  # Llama-3-8B's widths, and half of them (a CPU step of ~20 ms)
    "8b": dict(LLAMA3_8B, vocab_size=1024, bos_token_id=1, eos_token_id=2),
    "half": dict(LLAMA3_8B, vocab_size=1024, bos_token_id=1, eos_token_id=2,
                 hidden_size=2048, intermediate_size=7168, num_attention_heads=16,
                 num_key_value_heads=4),
}


def make_files(tmp: Path, width: str, layers: int, rank: int, loads: int,
               distinct: int = 4):
    """The model directory, the adapter root and the names of `loads` + 1 adapter
    directories in it (hard links of `distinct` weight sets: names differ, bytes are read
    and hashed all the same)."""
    model = write_model_dir(tmp / "model", layers, WIDTHS[width])
    sets = [write_adapter(tmp / "sets" / f"w{i}", model, rank, seed=i) for i in range(distinct)]
    root = tmp / "adapters"
    return model, root, link_adapters(root, sets, loads + 1)


def build_engine(args, model: Path, root: Path, loaders: int):
    from loramux_engine import Engine, EngineConfig

    cpu = args.device == "cpu"
    return Engine(EngineConfig(
        model=str(model), device=args.device, dtype="float32" if cpu else "bfloat16",
        load_format="dummy", max_loras=4, max_cpu_loras=2 * args.loads + 8,
        max_lora_rank=args.rank,
        num_kv_blocks=args.batch * MAX_TOKENS // 16 + 64 if cpu else None,
        max_num_seqs=args.batch, cpu_threads=args.threads if cpu else None,
        adapter_roots=(str(root),), adapter_loaders=loaders))


def start_decoding(eng, args) -> None:
    from loramux_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"r{i}", [3 + i, 5, 7, 11], params)
    for _ in range(4):   # prefill done, decode steps from here
        eng.step()


def timed_steps(eng, n: int | None = None, until=None) -> list[float]:
    out = []
    while (n is not None and len(out) < n) or (until is not None and not until()):
        t0 = time.perf_counter()
        eng.step()
        out.append(time.perf_counter() - t0)
    return out


def read_all(eng, root: Path, names: list[str], readers: int, while_waiting=None):
    """Read `names` on `readers` threads at once (calling `while_waiting` until every read
    landed, if given), then register them: (its results, wall seconds)."""
    pool = ThreadPoolExecutor(readers)
    t0 = time.perf_counter()
    futures = [pool.submit(eng.read_adapter, n, root / n) for n in names]
    out = while_waiting(lambda: all(f.done() for f in futures)) if while_waiting else None
    pool.shutdown()
    wall = time.perf_counter() - t0
    for f in futures:
        eng.register_adapter(f.result())
    return out, wall


def loader_pids(eng) -> list[int]:
    return eng.adapter_loaders.pids() if eng.adapter_loaders is not None else []


def idle_loads(eng, args, root: Path, names: list[str]) -> dict:
    """Loads of `names` into an idle engine: CPU seconds per load of the engine process
    and of the loader processes, loads per second."""
    c0, k0 = time.process_time(), children_cpu(loader_pids(eng))
    _, wall = read_all(eng, root, names, args.readers)
    return {"engine_cpu_ms_per_load": (time.process_time() - c0) / args.loads * 1e3,
            "loader_cpu_ms_per_load": (children_cpu(loader_pids(eng)) - k0) / args.loads * 1e3,
            "loads_per_s": args.loads / wall}


def stepping_loads(eng, args, root: Path, names: list[str]) -> dict:
    """Step times of decoding alone, then while `names` are read."""
    start_decoding(eng, args)
    timed_steps(eng, 3)
    base = timed_steps(eng, args.steps)
    steps, wall = read_all(eng, root, names, args.readers,
                           lambda done: timed_steps(eng, until=done))
    return {"step_ms_baseline": stats_ms(base), "step_ms_during_loads": stats_ms(steps),
            "steps_during_loads": len(steps), "loads_per_s_while_decoding": args.loads / wall}


def measure(args, model: Path, root: Path, names: list[str], path: str) -> dict:
    """The first of `names` read to warm up, then the next LOADS idle, the LOADS after
    while decoding. `path`: the adapter_loaders value; with a "u" after it, host buffers
    are page-locked unpopulated, as before 2026-11-27 (the driver faults their pages in)."""
    from loramux_engine.lora import host_buffers

    loaders, unpopulated = int(path.rstrip("u")), path.endswith("u")
    populate = host_buffers.populate
    if unpopulated:
        host_buffers.populate = lambda data, nbytes: False
    eng = build_engine(args, model, root, loaders)
    try:
        if eng.adapter_loaders is not None:
            eng.adapter_loaders.start()
            for pid in eng.adapter_loaders.pids() if args.pin else ():
                os.sched_setaffinity(pid, args.pin[1])
        eng.register_adapter(eng.read_adapter(names[0], root / names[0]))
        row = {"path": ("loader processes" if loaders else "in-process threads")
               + (", unpopulated" if unpopulated else ""), "adapter_loaders": loaders}
        row.update(idle_loads(eng, args, root, names[1:args.loads + 1]))
        row.update(stepping_loads(eng, args, root, names[args.loads + 1:]))
        return row
    finally:
        eng.close()
        del eng
        gc.collect()  # its host copies go before the next engine's
        host_buffers.populate = populate


def stats_ms(xs: list[float]) -> dict:
    return {"median": statistics.median(xs) * 1e3, "p90": pct(xs, 0.9) * 1e3,
            "max": max(xs) * 1e3}


def pin_engine(n: int):
    """Pin this process (every thread it starts from now on) to its first `n` cores, as
    the engine process of a GPU host has its own; (engine cores, loader cores), or None
    when not pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if n <= 0 or n >= len(cores):
        return None
    os.sched_setaffinity(0, cores[:n])
    return set(cores[:n]), set(cores[n:])


def pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def report(rows: list[dict], log) -> None:
    log("| path | engine CPU ms/load | loader CPU ms/load | loads/s idle | step ms "
        "alone med/p90 | step ms during loads med/p90/max | steps during | loads/s |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, d = r["step_ms_baseline"], r["step_ms_during_loads"]
        log(f"| {r['path']} | {r['engine_cpu_ms_per_load']:.1f} | "
            f"{r['loader_cpu_ms_per_load']:.1f} | {r['loads_per_s']:.1f} | "
            f"{b['median']:.1f} / {b['p90']:.1f} | {d['median']:.1f} / {d['p90']:.1f} / "
            f"{d['max']:.1f} | {r['steps_during_loads']} | "
            f"{r['loads_per_s_while_decoding']:.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--width", choices=sorted(WIDTHS), default="half")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--loads", type=int, default=24)
    ap.add_argument("--readers", type=int, default=4, help="threads calling read_adapter")
    ap.add_argument("--batch", type=int, default=8, help="requests decoding")
    ap.add_argument("--steps", type=int, default=20, help="baseline steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of a CPU engine")
    ap.add_argument("--paths", default="0,2,0,2",
                    help="adapter_loaders values to compare, in this order; 'u' after one: "
                         "host buffers page-locked without populating them first (as before)")
    ap.add_argument("--engine-cpus", type=int, default=1,
                    help="cores the engine process is pinned to (the loaders get the "
                         "others; 0: no pinning)")
    args = ap.parse_args()
    args.pin = pin_engine(args.engine_cpus)
    log = TeeLog(args.out / "bench_offproc_loads.log")
    log(f"args: {vars(args)}")
    with tempfile.TemporaryDirectory() as tmp:
        model, root, names = make_files(Path(tmp), args.width, args.layers, args.rank,
                                        2 * args.loads)
        mb = sum(f.stat().st_size for f in (root / names[0]).iterdir()) / 1e6
        log(f"adapter files: {mb:.1f} MB each")
        rows = [measure(args, model, root, list(names), n) for n in args.paths.split(",")]
    report(rows, log)
    (args.out / "bench_offproc_loads.json").write_text(json.dumps(rows, indent=2))
    log.close()


if __name__ == "__main__":
    main()
