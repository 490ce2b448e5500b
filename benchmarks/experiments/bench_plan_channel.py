"""Latency of one step plan from rank 0 to a worker over the gloo control group (CPU, TP=2).

    python benchmarks/experiments/bench_plan_channel.py [--batch 64] [--messages 400]

Two processes. Rank 0 sends a decode step's plan (encode_step of `batch` sequences, one
new token each, a new block every 16th) every 2 ms, so that messages do not queue; the
worker receives and decodes it. Latency = worker's decode done - rank 0's send start
(perf_counter is CLOCK_MONOTONIC, one clock for both processes on Linux). Compared:
the former protocol (a header broadcast, then a payload broadcast) and PlanChannel (one
broadcast when the plan fits FIRST values).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed

GAP_S = 0.002


class TwoBroadcasts:
    """The former wire protocol: header int64[3], then the payload."""

    def __init__(self, control, rank: int):
        self._pg, self._rank = control, rank

    def send(self, op, payload):
        self._pg.broadcast(torch.tensor([op, payload.numel(), 0]), 0).wait()
        self._pg.broadcast(payload.contiguous(), 0).wait()

    def recv(self):
        header = torch.empty(3, dtype=torch.int64)
        self._pg.broadcast(header, 0).wait()
        payload = torch.empty(int(header[1]), dtype=torch.int64)
        self._pg.broadcast(payload, 0).wait()
        return int(header[0]), payload


def _plan(batch: int, step: int):
    from loramux_engine.distributed.plan import SeqPlan, StepPlan, encode_step
    seqs = tuple(SeqPlan(h, 128 + step, 1, -1, True, (1000 + step,), False,
                         (h * 100 + step,) if step % 16 == 0 else ())
                 for h in range(1, batch + 1))
    return encode_step(StepPlan(seqs=seqs))


def _rank(rank: int, port: int, kind: str, batch: int, messages: int, out: str) -> None:
    sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed
    from loramux_engine.distributed import group as pg
    from loramux_engine.distributed.channel import PlanChannel
    from loramux_engine.distributed.plan import OP_STEP, decode_step

    torch.set_num_threads(1)
    store = pg.join_store(port)
    control = pg.connect(store, rank, 2, torch.device("cpu")).control
    ch = (PlanChannel if kind == "one" else TwoBroadcasts)(control, rank)
    plans = [_plan(batch, i) for i in range(messages)] if rank == 0 else None
    stamps = []
    for i in range(messages):
        if rank == 0:
            time.sleep(GAP_S)
            stamps.append(time.perf_counter())
            ch.send(OP_STEP, plans[i])
        else:
            _, payload = ch.recv()
            decode_step(payload)
            stamps.append(time.perf_counter())
    Path(out, f"{kind}{rank}.json").write_text(json.dumps(stamps))
    pg.agree_min(control, 0)


def measure(kind: str, batch: int, messages: int) -> dict:
    from loramux_engine.distributed import group as pg
    store = pg.open_store()
    out = tempfile.mkdtemp(prefix="loramux-chan-")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, store.port, kind, batch, messages, out))
             for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    sent = json.loads(Path(out, f"{kind}0.json").read_text())
    done = json.loads(Path(out, f"{kind}1.json").read_text())
    lat = sorted((d - s) * 1e6 for s, d in zip(sent, done))[messages // 10:]  # drop warm-up
    return {"protocol": kind, "batch": batch, "values": _plan(batch, 1).numel(),
            "median_us": statistics.median(lat), "p90_us": lat[int(len(lat) * 0.9)]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64, 256])
    ap.add_argument("--messages", type=int, default=400)
    args = ap.parse_args()
    for b in args.batch:
        for kind in ("two", "one"):
            r = measure(kind, b, args.messages)
            print(f"batch {b:3d} ({r['values']:5d} values) {kind} broadcast(s): median "
                  f"{r['median_us']:7.1f} us  p90 {r['p90_us']:7.1f} us", flush=True)


if __name__ == "__main__":
    main()
