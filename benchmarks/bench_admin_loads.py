"""AdapterAdmin loads at scale, through the real service (services/launcher.py Cluster:
engine, control plane and gateway processes, real gRPC and ZMQ).

N rank-16 adapters of the model's shape are loaded under new names with C concurrent
LoadAdapter callers (`--mode calls`), and/or through LoadAdapters batches of B items
(`--mode batch`), while S steady streams decode on the base model. Reported: loads per
second, and the decode step time of the live streams (median and p90 gap between
consecutive tokens of a stream, timed in a process of their own) in a window before the
loads and during them. Modes run in the order given (`--mode batch,calls`); the first one
takes fresh host memory for its copies, the later ones reuse what it freed.

The engine's host reserve (docs/ADAPTER_FILES.md) makes host buffers ready after start;
`--reserve` says what the first mode meets: `wait` (default) times loads once the reserve
is complete, as its gauges on the gateway's metrics say, and reports how long after
"serving" that was; `now` times them right after start, while the reserve is still being
made (its progress at the start and the end of the loads is reported); `off` starts the
engine without one (`--host-reserve-loras 0`: fresh host memory, as before it existed).

On the GPU the model is Llama-3-8B-shaped with dummy weights (benchmarks/llama8b.py), 84 MB
adapters; `--tiny` runs a tiny model on the CPU to check that the benchmark works. Only
`--distinct` adapter files are written; the other directories hard-link them (a thousand
84 MB files would not fit the disk; the loads are served from the page cache either way,
and every name still gets its own id).

    python -m benchmarks.adapters admin --out DIR --tiny
    python -m benchmarks.adapters admin --out DIR --adapters 1000 --concurrency 16
    python -m benchmarks.adapters admin --out DIR --adapters 1000 --mode calls --reserve now
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed

from dataclasses import dataclass  # noqa: E402

from benchmarks.host_reserve_gauges import (reserve_state, reserve_text,  # noqa: E402
                                            wait_reserve)
from benchmarks.llama8b import LLAMA3_8B, write_adapter, write_model_dir  # noqa: E402

TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            bos_token_id=1, eos_token_id=2)


def parse_modes(text: str) -> tuple[str, ...]:
    modes = ("calls", "batch") if text == "both" else tuple(text.split(","))
    if not modes or any(m not in ("calls", "batch") for m in modes):
        raise argparse.ArgumentTypeError(f"--mode {text!r}: calls, batch, both or a list")
    return modes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU")
    p.add_argument("--adapters", type=int, default=None, help="N (default: 1000; tiny 120)")
    p.add_argument("--distinct", type=int, default=16, help="distinct adapter files")
    p.add_argument("--concurrency", type=int, default=16, help="C concurrent LoadAdapter calls")
    p.add_argument("--batch", type=int, default=100, help="B items per LoadAdapters call")
    p.add_argument("--mode", type=parse_modes, default="both",
                   help="calls, batch, or both in an order: calls,batch (= both) or "
                        "batch,calls. The first mode's host copies take fresh memory (page "
                        "faults, page-locking); later modes reuse what the first one freed")
    p.add_argument("--streams", type=int, default=8, help="S live decode streams")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="host copies (default: the engine's own sizing; loads past the host "
                        "tier are registered lazily, as in service)")
    p.add_argument("--reserve", choices=("wait", "now", "off"), default="wait",
                   help="wait: time loads once the engine's host reserve is complete; now: "
                        "right after start; off: an engine without one (module docstring)")
    p.add_argument("--host-reserve-loras", type=int, default=None,
                   help="the engine's host reserve (default: its own: max_cpu_loras on CUDA; "
                        "on the CPU, --tiny, 16)")
    p.add_argument("--window", type=float, default=None, help="seconds of decode before loads")
    p.add_argument("--out", default=None, help="directory for the JSON result")
    return p.parse_args(argv)


def make_files(tmp: Path, args) -> tuple[Path, Path, list[str]]:
    model = write_model_dir(tmp / "model", base=TINY if args.tiny else LLAMA3_8B)
    root = tmp / "adapters"
    firsts = [write_adapter(root / f"f{i}", model, rank=16, seed=i) for i in range(args.distinct)]
    names = []
    for i in range(args.adapters):
        d = root / f"a{i}"
        if i >= args.distinct:
            d.mkdir()
            for f in firsts[i % args.distinct].iterdir():
                os.link(f, d / f.name)
        else:
            firsts[i].rename(d)
            firsts[i] = d
        names.append(d.name)
    return model, root, names


def cluster_config(tmp: Path, model: Path, root: Path, args):
    from loramux_services.launcher import ClusterConfig

    device = ("--device", "cpu", "--dtype", "float32") if args.tiny else ("--dtype", "bfloat16")
    cpu_loras = ("--max-cpu-loras", str(args.max_cpu_loras)) if args.max_cpu_loras else ()
    reserve = 0 if args.reserve == "off" else args.host_reserve_loras
    if reserve is None and args.tiny:
        reserve = 16   # the CPU makes none by default
    reserve_flag = () if reserve is None else ("--host-reserve-loras", str(reserve))
    return ClusterConfig(
        model=str(model), adapter_roots=(str(root),), workdir=str(tmp / "run"),
        metrics_port=0,   # the host reserve's gauges
        engine_args=(*device, "--load-format", "dummy", "--max-lora-rank", "16",
                     "--max-loras", "8", *cpu_loras, *reserve_flag,
                     "--max-num-seqs", str(max(16, args.streams)), "--max-model-len", "4096"),
        env={"OMP_NUM_THREADS": "2"} if args.tiny else {})


class Streams:
    """S base-model streams that decode until stopped, in a process of their own: the
    token arrival times are taken there, so the load callers of this process (16 asyncio
    gRPC calls hold its interpreter lock often) cannot stretch the gaps they measure.
    Times are time.monotonic(), one clock for both processes."""

    def __init__(self, gateway: str, n: int, vocab: int):
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_streams_main, args=(gateway, n, vocab, child),
                                 daemon=True)
        self._proc.start()
        child.close()
        if not self._conn.poll(120) or self._conn.recv() != "started":
            raise RuntimeError("the decode streams' process did not start")

    def gaps_ms(self, t0: float, t1: float) -> list[float]:
        """Gaps between consecutive tokens of each stream that arrived within [t0, t1]."""
        self._conn.send(("times", t0, t1))
        out = []
        for inside in self._conn.recv():
            out += [(b - a) * 1e3 for a, b in zip(inside, inside[1:]) if b > a]
        return out

    def close(self) -> None:
        try:
            self._conn.send(("stop",))
            self._conn.recv()
        except (OSError, EOFError):
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()


def _streams_main(gateway: str, n: int, vocab: int, conn) -> None:
    from loramux import GenerateClient

    client = GenerateClient(gateway)
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(n)]

    def run(i: int) -> None:
        prompt = [(7 * i + j) % (vocab - 3) + 3 for j in range(16)]
        while not stop.is_set():
            it = client.stream(prompt, max_tokens=4000, temperature=0.0, ignore_eos=True)
            for resp in it:
                times[i].extend([time.monotonic()] * max(1, len(resp.token_ids)))
                if stop.is_set():
                    it.close()
                    break

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    conn.send("started")
    while True:
        msg = conn.recv()
        if msg[0] == "stop":
            break
        _, t0, t1 = msg
        conn.send([[t for t in list(ts) if t0 <= t <= t1] for ts in times])
    stop.set()
    for t in threads:
        t.join(30)
    client.close()
    conn.send("stopped")


async def load_calls(control: str, names: list[str], prefix: str, concurrency: int) -> list[str]:
    """LoadAdapter for every name by `concurrency` callers; the failures, as text."""
    from loramux import LoramuxError
    from loramux.aio import AsyncAdminClient

    todo, failed = list(names), []
    async with AsyncAdminClient(control) as admin:
        async def caller():
            while todo:
                name = todo.pop()
                try:
                    await admin.load(f"{prefix}{name}", name)
                except LoramuxError as err:
                    failed.append(f"{name}: {err.code.name} {err.details}")
        await asyncio.gather(*(caller() for _ in range(concurrency)))
    return failed


def load_batches(control: str, names: list[str], prefix: str, batch: int) -> list[str]:
    """LoadAdapters of `batch` items at a time; the items that failed, as text."""
    from loramux import AdminClient

    failed = []
    with AdminClient(control, timeout=600) as admin:
        for i in range(0, len(names), batch):
            items = [(f"{prefix}{n}", n) for n in names[i:i + batch]]
            for result in admin.load_many(items):
                if result.code.name != "OK":
                    failed.append(f"{result.name}: {result.code.name} {result.message}")
    return failed


def summary(gaps: list[float]) -> dict:
    if not gaps:
        return {"median_ms": None, "p90_ms": None, "tokens": 0}
    gaps = sorted(gaps)
    return {"median_ms": round(statistics.median(gaps), 3),
            "p90_ms": round(gaps[int(0.9 * (len(gaps) - 1))], 3), "tokens": len(gaps)}


@dataclass(frozen=True)
class Service:
    """Where the started service is: its AdapterAdmin address, the gateway's metrics, and
    when it began to serve (time.monotonic())."""
    control_address: str
    metrics_url: str
    serving_at: float


def run_mode(mode: str, service: Service, names: list[str], streams: Streams, args,
             prefix: str) -> dict:
    window = args.window or (3.0 if args.tiny else 5.0)
    t0 = time.monotonic()
    time.sleep(window)
    t1 = time.monotonic()
    reserve_before = reserve_state(service.metrics_url)
    if mode == "calls":
        failed = asyncio.run(load_calls(service.control_address, names, prefix, args.concurrency))
    else:
        failed = load_batches(service.control_address, names, prefix, args.batch)
    t2 = time.monotonic()
    reserve_after = reserve_state(service.metrics_url)
    before, during = summary(streams.gaps_ms(t0, t1)), summary(streams.gaps_ms(t1, t2))
    ratio = (during["median_ms"] / before["median_ms"]
             if before["median_ms"] and during["median_ms"] else None)
    return {"mode": mode, "adapters": len(names), "seconds": round(t2 - t1, 3),
            "loads_per_s": round(len(names) / (t2 - t1), 1), "failed": failed[:10],
            "decode_before": before, "decode_during": during,
            "decode_slowdown": None if ratio is None else round(ratio, 3),
            "loads_after_serving_s": round(t1 - service.serving_at, 1),
            "reserve_before": reserve_before, "reserve_after": reserve_after}


def warm_up(control: str, paths: list[str]) -> None:
    """A few loads at once and their unloads first: on the CPU the engine starts each
    loader process at the first read that needs it (a second's start-up, not the cost of
    a load; on CUDA they are started ahead)."""
    from loramux import AdminClient

    with AdminClient(control, timeout=600) as admin:
        names = [f"warm-up-{i}" for i in range(len(paths))]
        admin.load_many(list(zip(names, paths)))
        for name in names:
            admin.unload(name)


def unload_all(control: str, prefix: str) -> None:
    from loramux import AdminClient

    with AdminClient(control, timeout=600) as admin:
        for a in admin.list():
            if a.name.startswith(prefix):
                admin.unload(a.name)


def table(rows: list[dict]) -> None:
    print("\n| mode | host memory | reserve ready/target: before, after | loads from "
          "serving (s) | adapters | s | loads/s | decode step before (median/p90 ms) | "
          "during | slowdown | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        b, d = r["decode_before"], r["decode_during"]
        print(f"| {r['mode']} | {r.get('host_memory')} | {reserve_text(r)} | "
              f"{r['loads_after_serving_s']} | {r['adapters']} | {r['seconds']} | "
              f"{r['loads_per_s']} | "
              f"{b['median_ms']}/{b['p90_ms']} | {d['median_ms']}/{d['p90_ms']} | "
              f"{r['decode_slowdown']} | {len(r['failed'])} |")


def main(argv=None) -> int:
    from loramux_services.launcher import Cluster, wait_serving

    args = parse_args(argv)
    args.adapters = args.adapters or (120 if args.tiny else 1000)
    args.distinct = min(args.distinct, args.adapters)
    with tempfile.TemporaryDirectory(prefix="bench-admin-loads-") as tmp:
        tmp = Path(tmp)
        model, root, names = make_files(tmp, args)
        cluster = Cluster(cluster_config(tmp, model, root, args))
        rows, reserve = [], None
        try:
            cluster.start()
            ready = cluster.wait_ready(timeout_s=900)
            wait_serving(cluster.gateway_address, timeout_s=900)
            service = Service(cluster.control_address, f"http://127.0.0.1:"
                              f"{ready['gateway']['metrics_port']}/metrics", time.monotonic())
            if args.reserve == "wait":
                reserve = wait_reserve(service.metrics_url, timeout_s=900)
                reserve["complete_after_serving_s"] = round(
                    time.monotonic() - service.serving_at, 1)
                print(f"host reserve complete {reserve['complete_after_serving_s']} s after "
                      f"serving: {reserve}", flush=True)
            warm_up(cluster.control_address, names[:8])
            vocab = json.loads((model / "config.json").read_text())["vocab_size"]
            streams = Streams(cluster.gateway_address, args.streams, vocab)
            try:
                modes = args.mode
                for k, mode in enumerate(modes):
                    prefix = f"{mode[0]}{k}-"
                    rows.append(run_mode(mode, service, names, streams, args, prefix))
                    rows[-1]["host_memory"] = "reused" if k else (
                        "fresh" if args.reserve == "off" else f"reserve ({args.reserve})")
                    if k + 1 < len(modes):
                        unload_all(cluster.control_address, prefix)
            finally:
                streams.close()
        finally:
            cluster.close()
            if args.out:   # the engine's log names its loaders and host copies
                logs = Path(args.out) / "logs"
                logs.mkdir(parents=True, exist_ok=True)
                for log in (tmp / "run").glob("*.log"):
                    (logs / log.name).write_bytes(log.read_bytes())
    result = {"tiny": args.tiny, "concurrency": args.concurrency, "batch": args.batch,
              "reserve": args.reserve, "reserve_waited": reserve,
              "max_cpu_loras": args.max_cpu_loras,
              "streams": args.streams, "distinct_files": args.distinct, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "admin_loads.json").write_text(json.dumps(result, indent=2))
    table(rows)
    return 0 if all(not r["failed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
