"""Serving benchmark: the real service (control plane, engine, gateway, started by the same
launcher as `loramux serve`, with its defaults unless flags are given) driven through the
client SDK, and the same workload through the offline engine in the same invocation.

    python benchmarks/bench_serving.py --out DIR                       # GPU, 8B shape
    python benchmarks/bench_serving.py --out DIR --rate 8 --adapters 1000 --popularity zipf:1
    python benchmarks/bench_serving.py --out DIR --sweep 2,4,8,16      # latency vs throughput
    python benchmarks/bench_serving.py --out DIR --adapters 1,32,256,1000 --rate 8
    python benchmarks/bench_serving.py --out DIR --tiny                # CPU, demo model
    python benchmarks/bench_serving.py --out DIR -- --max-loras 32     # after --: serve flags

Load: Poisson arrivals at --rate requests/s, or a closed loop of --concurrency streams.
Adapters: --adapters N (or a comma list: one run per count) names a0000.., hard links of
--distinct-weights weight sets; popularity uniform or zipf:ALPHA (seeded ranking). The
model is Llama-3-8B-shaped with random weights (`--load-format dummy`, the one flag added
to serve's defaults), rank-16 adapters on all seven projections. Reports req/s, output
tok/s, TTFT / ITL / end-to-end p50/p90/p99, SLO attainment (TTFT <= --slo-ttft and mean
ITL <= --slo-itl), the engine's adapter disk reads and slot loads during the run, the
offline engine's numbers and the ratio service/offline. Writes serving.json, table.md
and plots (matplotlib, if installed) to --out; prints the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "clients" / "python")]

from benchmarks.serving import counters, report  # noqa: E402
from benchmarks.serving.drivers import run_offline, run_service  # noqa: E402
from benchmarks.serving.files import prepare  # noqa: E402
from benchmarks.serving.workload import (make_workload, parse_lengths,  # noqa: E402
                                         parse_popularity, summarize)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="the demo model on the CPU, small load")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--concurrency", default=None,
                   help="closed loop: streams in flight, or a comma list (one run each; "
                        "default 64, 4 with --tiny)")
    p.add_argument("--sweep", default=None, help="comma list of rates: one run per rate")
    p.add_argument("--adapters", default=None,
                   help="adapter count, or a comma list (one run per count); default 64 (2 tiny)")
    p.add_argument("--popularity", default="uniform", help="uniform, zipf or zipf:ALPHA")
    p.add_argument("--distinct-weights", type=int, default=4,
                   help="distinct adapter weight sets the N adapter dirs link to")
    p.add_argument("--num-requests", type=int, default=None,
                   help="per run (default: 4 x concurrency, or 30 s of arrivals; 16 tiny)")
    p.add_argument("--input-len", default=None, help="N or LO-HI (default 128-512; 8-32 tiny)")
    p.add_argument("--output-len", default=None, help="N or LO-HI (default 128-256; 8-16 tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=0.1, help="seconds")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick GPU check)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine runs")
    p.add_argument("--workdir", type=Path, default=None, help="model/adapter files (kept)")
    return p


def _defaults(args) -> None:
    tiny = args.tiny
    if args.rate is None and args.sweep is None and args.concurrency is None:
        args.concurrency = "4" if tiny else "64"
    args.adapter_counts = [int(x) for x in (args.adapters or ("2" if tiny else "64")).split(",")]
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else \
        [args.rate] if args.rate is not None else []
    # (rate, None): Poisson arrivals; (None, C): a closed loop of C streams
    args.loads = [(r, None) for r in rates] + [
        (None, int(c)) for c in (args.concurrency.split(",") if args.concurrency else [])]
    args.input_len = parse_lengths(args.input_len or ("8-32" if tiny else "128-512"))
    args.output_len = parse_lengths(args.output_len or ("8-16" if tiny else "128-256"))
    args.alpha = parse_popularity(args.popularity)


def _num_requests(args, rate: float | None, concurrency: int | None) -> int:
    if args.num_requests:
        return args.num_requests
    if args.tiny:
        return 16
    return 4 * concurrency if rate is None else max(32, int(rate * 30))


def _points(args, names: tuple[str, ...], vocab: range) -> list[dict]:
    """One workload per (adapter count, rate), each from the same seed."""
    points = []
    for n in args.adapter_counts:
        for rate, concurrency in args.loads:
            wl = make_workload(_num_requests(args, rate, concurrency), list(names[:n]),
                               args.alpha, args.input_len, args.output_len, vocab, rate,
                               args.seed)
            points.append({"adapters": n, "rate": rate, "concurrency": concurrency,
                           "workload": wl})
    return points


def _warmup(args, points, names, vocab) -> tuple[list, int]:
    """One round both paths run untimed before their first point: a closed loop as wide as
    the widest load (32 streams for rate runs), prompts from the runs' length range,
    outputs of 4-32 tokens so the batch ramps down through every size, over every adapter
    the runs use. Compiles, autotuning and first slot copies happen here, not in a run.
    Returns (workload, streams): run_service's and run_offline's arguments."""
    width = max([p["concurrency"] or 32 for p in points])
    used = list(names[:max(p["adapters"] for p in points)])
    return make_workload(2 * width, [None, *used], None, args.input_len, (4, 32), vocab,
                         None, args.seed + 1), width


def _event_counters(cluster) -> dict | None:
    """The engine's counters from its next event (None if none comes)."""
    msg = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event", 5)
    return None if msg is None else counters.from_event(msg.event)


def _keep_logs(workdir: str, out: Path) -> None:
    """The services' logs next to the results (the engine's resolved config, errors)."""
    (out / "logs").mkdir(exist_ok=True)
    for log in Path(workdir).glob("*.log"):
        shutil.copyfile(log, out / "logs" / log.name)


def run_service_points(args, files, points, warmup, serve_argv: list[str], work: Path) -> dict:
    """Start the service, load the adapters, warm up, run every point; the engine's
    resolved config."""
    from loramux import AdminClient

    from services.launcher import Cluster, wait_serving
    from services.serve_args import Plan, cluster_config, parse_args

    serve_dir = tempfile.mkdtemp(prefix="serve-", dir=work)  # a fresh registry each run
    flags = ["--model", str(files.model), "--adapter-root", str(files.adapter_root),
             "--gateway-port", "0", "--control-port", "0", "--metrics-port", "-1",
             "--http-port", "0", "--workdir", serve_dir, *serve_argv]
    if files.dummy_weights and "--load-format" not in serve_argv:
        flags += ["--load-format", "dummy"]
    plan = Plan(str(files.model), (str(files.adapter_root),), serve_dir, False)
    cfg = cluster_config(parse_args(flags), plan)
    path = os.pathsep.join(p for p in (*sys.path[:2], os.environ.get("PYTHONPATH")) if p)
    cfg.env["PYTHONPATH"] = path  # the services run this checkout, wherever we are called from
    try:
        with Cluster(cfg) as cluster:
            cluster.start()
            ready = cluster.wait_ready(timeout_s=900)
            wait_serving(cluster.gateway_address, timeout_s=900)
            used = files.names[:max(p["adapters"] for p in points)]
            t = time.perf_counter()
            with AdminClient(cluster.control_address) as admin:
                for i, name in enumerate(used):
                    admin.load(name, name)
                    if (i + 1) % 100 == 0:
                        print(f"  loaded {i + 1}/{len(used)} adapters", flush=True)
            args.adapter_load_s = time.perf_counter() - t
            print(f"service: {len(used)} adapters loaded in {args.adapter_load_s:.1f} s; "
                  f"engine: {ready['engine'].get('config')}", flush=True)
            args.warmup_s = {"service": _timed(run_service, cluster.gateway_address, *warmup)}
            pids = {"client": None, **{n: ready[n].get("pid") for n in ("gateway", "engine")}}
            for p in points:
                before = _event_counters(cluster)
                (records, wall), cpu = counters.busy_share(pids, lambda: run_service(
                    cluster.gateway_address, p["workload"], p["concurrency"]))
                p["service"] = summarize(records, wall, args.slo_ttft, args.slo_itl)
                p["service"]["engine"] = counters.during(_event_counters(cluster), before)
                p["service"]["cpu_busy"] = cpu  # per process: CPU s / wall s
                _say("service", p)
    finally:
        _keep_logs(serve_dir, args.out)
    return ready["engine"]["config"]


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def run_offline_points(args, files, points, warmup, config: dict) -> None:
    """The same workloads through an in-process Engine with the service's resolved config,
    after the same warm-up round."""
    from engine import Engine, EngineConfig

    with Engine(EngineConfig(**config)) as engine:
        for name in files.names[:max(p["adapters"] for p in points)]:
            engine.add_adapter(name, str(files.adapter_root / name))
        args.warmup_s["offline"] = _timed(run_offline, engine, *warmup)
        for p in points:
            before = counters.from_engine(engine)
            records, wall = run_offline(engine, p["workload"], p["concurrency"])
            p["offline"] = summarize(records, wall, args.slo_ttft, args.slo_itl)
            p["offline"]["engine"] = counters.during(counters.from_engine(engine), before)
            s, o = p["service"]["output_tok_per_s"], p["offline"]["output_tok_per_s"]
            p["service_over_offline"] = s / o if s and o else None
            _say("offline", p)


def _say(system: str, p: dict) -> None:
    s = p[system]
    load = f"rate {p['rate']:g}" if p["rate"] is not None else f"{p['concurrency']} streams"
    print(f"{system:8s} adapters={p['adapters']:5d} {load}: {s['req_per_s']:.2f} req/s "
          f"{s['output_tok_per_s']:.1f} tok/s TTFT p99 {s['ttft_s']['p99']} "
          f"SLO {s['slo']['attainment']} errors {s['errors']}", flush=True)


def _meta(args, argv: list[str], config: dict) -> dict:
    try:
        import torch
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - metadata only
        device = "unknown"
    commit = os.environ.get("LORAMUX_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit, "argv": argv, "engine_config": config,
            "adapter_load_s": getattr(args, "adapter_load_s", None),
            "adapters_loaded": max(args.adapter_counts),
            "order": "service, then offline (each after the same untimed warm-up round)",
            "warmup_s": getattr(args, "warmup_s", None),
            "popularity": args.popularity, "input_len": args.input_len,
            "output_len": args.output_len, "seed": args.seed,
            "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl}}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    _defaults(args)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="loramux-bench-serving-"))
    files = prepare(work, tiny=args.tiny, num_adapters=max(args.adapter_counts),
                    distinct=args.distinct_weights, layers=args.layers)
    points = _points(args, files.names, files.vocab)
    warmup = _warmup(args, points, files.names, files.vocab)
    config = run_service_points(args, files, points, warmup, serve_argv, work)
    if not args.no_offline:
        run_offline_points(args, files, points, warmup, config)
    for p in points:
        p["requests"] = len(p.pop("workload"))
    result = {"meta": _meta(args, argv, config), "points": points}
    (args.out / "serving.json").write_text(json.dumps(result, indent=2, default=_jsonable))
    text = report.table(points, result["meta"])
    (args.out / "table.md").write_text(text + "\n")
    plots = []
    if sum(r is not None for r, _ in args.loads) > 1 and report.plot_rate_sweep(points, args.out / "latency_vs_throughput.png"):
        plots.append("latency_vs_throughput.png")
    if len(args.adapter_counts) > 1 and report.plot_adapter_sweep(points, args.out / "adapters.png"):
        plots.append("adapters.png")
    print(f"\n{result['meta']['device']}, commit {result['meta']['commit']}, "
          f"plots: {', '.join(plots) or 'none (no matplotlib or single point)'}\n{text}")
    return 0


def _jsonable(x):
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else str(x)


if __name__ == "__main__":
    sys.exit(main())
