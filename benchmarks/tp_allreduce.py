"""The `allreduce` phase of bench_tp.py: the one-shot all-reduce (symmetric memory) against
NCCL on two GPUs, for [rows, 4096] bf16 messages of 1..256 rows.

Two processes (spawned; groups through engine/distributed/group.py as the engine builds
them). Checks, on fresh random inputs per size and rank: the one-shot sum equals NCCL's,
eagerly and inside a captured CUDA graph replayed with new inputs copied into its static
input; both ranks must pass. Then times a CUDA graph of 50 back-to-back all-reduces of
each kind (microseconds per all-reduce, median of 10 replays, ranks lined up before each).
Rank 0 prints the table and writes allreduce.json.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN = 4096
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GRAPH_ROWS = (1, 64, 256)
PER_GRAPH = 50
REPLAYS = 10
REL_TOL = 1e-2   # two bf16 addends: both sides round the same float sum, so 0 is expected


def run(out: Path, size: int = 2, timeout_s: float = 120.0) -> dict:
    from loramux_engine.distributed import group as pg

    store = pg.open_store()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, size, store.port, str(out)), daemon=True)
             for r in range(size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:   # a rank stuck in a collective: never leave it holding a GPU
        if p.is_alive():
            p.kill()
            p.join(5.0)
    codes = [p.exitcode for p in procs]
    path = out / "allreduce.json"
    res = json.loads(path.read_text()) if path.exists() else {"ok": False}
    res["exit_codes"] = codes  # the checks decide: rank 0 wrote the agreed outcome
    res["ok"] = bool(res.get("ok"))
    return res


def _log(rank: int, msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] rank {rank}: {msg}", flush=True)


def _rank(rank: int, size: int, port: int, out: str) -> None:
    sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
    from loramux_engine.distributed import group as pg
    from loramux_engine.distributed.fast_allreduce import OneShotAllReduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    groups = pg.connect(pg.join_store(port), rank, size, device)
    tp, control = groups.tp, groups.control
    reducer, why = OneShotAllReduce.create(tp, control, max(ROWS) * HIDDEN, torch.bfloat16,
                                           device)
    _log(rank, f"one-shot set-up: {'ok' if reducer else why}")
    res = {"setup": why or "ok", "checks": [], "timings": []}
    ok = reducer is not None
    if ok:
        res["checks"] = _checks(reducer, rank)
        ok = all(c["ok"] for c in res["checks"])
    ok = pg.agree_min(control, int(ok)) == 1   # both ranks passed
    res["ok"] = ok
    for rows in ROWS:
        row = {"rows": rows, "bytes": rows * HIDDEN * 2,
               "nccl_us": _time(lambda x: dist.all_reduce(x), rows, device) * 1e6}
        if ok:
            row["oneshot_us"] = _time(reducer.all_reduce, rows, device) * 1e6
        res["timings"].append(row)
    if rank == 0:
        _print(res)
        Path(out, "allreduce.json").write_text(json.dumps(res, indent=1))
    pg.agree_min(control, 0)
    sys.stdout.flush()
    # the results are out: skip the teardown of NCCL and of the mapped peer buffers,
    # which must not be what decides this phase (or hangs it)
    os._exit(0)


def _close(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    err = float((got.float() - want.float()).abs().max())
    return err <= REL_TOL * float(want.float().abs().max()), err


def _checks(reducer, rank: int) -> list[dict]:
    """Eager at every size, then CUDA graphs replayed with fresh inputs."""
    out = []
    for rows in ROWS:
        gen = torch.Generator(device="cuda").manual_seed(1000 * rank + rows)
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        # poison this rank's symmetric buffer (peers finished reading it: the previous
        # kernel ends in a barrier): a missed copy-in shows up as NaN in the peer's sum
        reducer._buf.fill_(float("nan"))
        reducer.all_reduce(got)
        torch.cuda.synchronize()
        ok, err = _close(got, want)
        out.append({"kind": "eager", "rows": rows, "ok": ok, "max_abs_err": err})
    for rows in GRAPH_ROWS:
        static = torch.zeros(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        graph = _capture(lambda: reducer.all_reduce(static))
        gen = torch.Generator(device="cuda").manual_seed(7 + rank)
        for replay in range(3):
            fresh = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
            want = fresh.clone()
            dist.all_reduce(want)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            ok, err = _close(static, want)
            out.append({"kind": f"graph replay {replay}", "rows": rows, "ok": ok,
                        "max_abs_err": err})
    return out


def _capture(fn) -> torch.cuda.CUDAGraph:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _time(reduce, rows: int, device) -> float:
    """Seconds per all-reduce: a graph of PER_GRAPH in place on one buffer (zeros, so the
    sums stay finite), ranks lined up before each replay."""
    x = torch.zeros(rows, HIDDEN, device=device, dtype=torch.bfloat16)

    def many():
        for _ in range(PER_GRAPH):
            reduce(x)
    graph = _capture(many)
    times = []
    for _ in range(REPLAYS):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / PER_GRAPH)
    return statistics.median(times)


def _print(res: dict) -> None:
    bad = [c for c in res["checks"] if not c["ok"]]
    print(f"one-shot set-up: {res['setup']}; checks: {len(res['checks']) - len(bad)} of "
          f"{len(res['checks'])} ok" + (f"; FAILED: {bad[:4]}" if bad else ""), flush=True)
    print(f"{'rows':>5} {'KiB':>6} {'nccl us':>8} {'1shot us':>9} {'speedup':>8}")
    for r in res["timings"]:
        one = r.get("oneshot_us")
        print(f"{r['rows']:5d} {r['bytes'] / 1024:6.0f} {r['nccl_us']:8.1f} "
              + (f"{one:9.1f} {r['nccl_us'] / one:7.2f}x" if one else f"{'-':>9} {'-':>8}"),
              flush=True)
    print(f"allreduce: {'PASS' if res['ok'] else 'FAIL'}", flush=True)
