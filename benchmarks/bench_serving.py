"""Serving benchmark: the real service (control plane, engine, gateway, started by the same
launcher as `loramux serve`, with its defaults unless flags are given) driven through the
client SDK, and the same workload through the offline engine in the same invocation.

    python -m benchmarks.serving --out DIR                       # GPU, 8B shape
    python -m benchmarks.serving --out DIR --rate 8 --adapters 1000 --popularity zipf:1
    python -m benchmarks.serving --out DIR --sweep 2,4,8,16      # latency vs throughput
    python -m benchmarks.serving --out DIR --adapters 1,32,256,1000,2000 \\
        --popularity uniform,zipf:1 --concurrency 256 --cold-first --no-offline
    python -m benchmarks.serving --out DIR --concurrency 256 --no-offline \\
        --points 5/zipf:1,32/uniform,256/uniform,1000/zipf:1,2000/zipf:1 --cold-first \\
        --background-loads --warm-s 4 --point-s 17 --drain-s 5   # issue 20's round
    python -m benchmarks.serving --out DIR --tiny                # CPU, demo model
    python -m benchmarks.serving --out DIR -- --max-loras 32     # after --: serve flags

Points: every (adapter count, popularity, load) of --adapters, --popularity and the loads
(--rate / --sweep: Poisson arrivals; --concurrency: closed loops), each with its own seeded
workload. One service start serves them all: the largest count of adapters is loaded once,
concurrently (--load-workers LoadAdapter calls in flight), and each point uses its first
N. Then, after the service has stopped and its GPU memory is back, the offline engine is
built with the service's resolved config, warmed up the way the engine server warms up
(Engine.warm_up, then the same untimed warm-up round), loads the same adapters and runs
the same points. A row is printed (and serving.json rewritten) as each point finishes.

Adapters are a0000.. (hard links of --distinct-weights weight sets); popularity uniform or
zipf:ALPHA (seeded ranking). The model is Llama-3-8B-shaped with random weights
(`--load-format dummy`, the one flag added to serve's defaults), rank-16 adapters on all
seven projections. Reported per point: req/s, output tok/s, TTFT / ITL / end-to-end
p50/p90/p99, SLO attainment (TTFT <= --slo-ttft and mean ITL <= --slo-itl), swaps into
slots and bytes moved per second, disk reads, CPU cores used by the engine, gateway and
client processes (from /proc), the offline engine's numbers and service/offline.
--cold-first skips the warm-up round and runs the first point twice: the first timed round
after start against the steady state. --points names the points (N/POPULARITY) in the order
they run. --warm-s makes every point windowed: its first WARM_S seconds are its own warm-up
and it is measured until --point-s (throughput: the tokens that arrived in the window;
latency: the requests sent in it; adapter movement and CPU: snapshots at the window's
edges); the first round and its repeat are also summarized from their start (all the
first round served). --background-loads loads only the first point's adapters before it
(the first alone: one LoadAdapter's latency) and the others while the points run, the
first point once more meanwhile (round "during loads"); each row counts the loads that
completed in its window. Time bounds: --load-s (no adapter load starts
later; points needing more adapters are skipped), --point-s (no request sent later into
a point), --drain-s (what still runs that much later is cancelled), --deadline-s (points
that could not end in time are skipped). Points run load by load (--rate first, then
--sweep, then --concurrency), each at every adapter count and popularity. Writes serving.json, table.md and the plots
(matplotlib, if installed) to --out; prints the table last.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # last: hides nothing installed

from benchmarks.serving import report  # noqa: E402
from benchmarks.serving.drivers import Limits  # noqa: E402
from benchmarks.serving.files import adapter_root, model_dir, prepare  # noqa: E402
from benchmarks.serving.phases import (ServiceFiles, run_offline_points,  # noqa: E402
                                       run_service_points)
from benchmarks.serving.plan import Budget, Load, make_points, parse_point_specs  # noqa: E402
from benchmarks.serving.workload import parse_lengths, parse_popularity  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true", help="the demo model on the CPU, small load")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals, requests/s")
    p.add_argument("--concurrency", default=None,
                   help="closed loop: streams in flight, or a comma list (default 64, 4 tiny)")
    p.add_argument("--sweep", default=None, help="comma list of Poisson rates")
    p.add_argument("--adapters", default=None,
                   help="adapter count, or a comma list; default 64 (2 tiny)")
    p.add_argument("--popularity", default="uniform",
                   help="uniform, zipf or zipf:ALPHA, or a comma list of them")
    p.add_argument("--distinct-weights", type=int, default=4,
                   help="distinct adapter weight sets the N adapter dirs link to")
    p.add_argument("--load-workers", type=int, default=32,
                   help="adapter loads in flight at once (service RPCs, offline reads)")
    p.add_argument("--load-s", type=float, default=None,
                   help="no adapter load starts later than this; points needing more "
                        "adapters than were loaded are skipped (default: no limit)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="per point (default: 4 x concurrency, or 30 s of arrivals; 16 tiny)")
    p.add_argument("--input-len", default=None, help="N or LO-HI (default 128-512; 8-32 tiny)")
    p.add_argument("--output-len", default=None, help="N or LO-HI (default 128-256; 8-16 tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--slo-itl", type=float, default=0.1, help="seconds")
    p.add_argument("--point-s", type=float, default=None,
                   help="no request is sent later than this into a point (default: no limit)")
    p.add_argument("--drain-s", type=float, default=None,
                   help="requests still running this long after --point-s are cancelled "
                        "(default: 30 with --point-s, else no limit)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="skip points that could not end this many seconds after the start")
    p.add_argument("--cold-first", action="store_true",
                   help="no warm-up round; the first point runs twice (first round after "
                        "start, then steady state)")
    p.add_argument("--warm-s", type=float, default=None,
                   help="windowed points: the first WARM_S seconds of each point are not "
                        "measured; the window ends at --point-s (required with it), and the "
                        "drain only waits for the first tokens of the window's requests")
    p.add_argument("--points", default=None,
                   help="N/POPULARITY,... (e.g. 5/zipf:1,1000/zipf:1): these points in "
                        "this order, instead of every --adapters x --popularity")
    p.add_argument("--background-loads", action="store_true",
                   help="load only the first point's adapters before it; the others load "
                        "while points run (a repeat of the first point, round 'during "
                        "loads', measures what loads cost the traffic); each point starts "
                        "once its adapters are loaded")
    p.add_argument("--settle-s", type=float, default=30.0,
                   help="with --background-loads: seconds (over the run) points may wait "
                        "for outstanding loads to finish before they start")
    p.add_argument("--layers", type=int, default=None, help="fewer layers (a quick GPU check)")
    p.add_argument("--no-offline", action="store_true", help="skip the offline engine runs")
    p.add_argument("--workdir", type=Path, default=None,
                   help="model/adapter files and the Triton cache (kept)")
    return p


def _defaults(args) -> None:
    tiny = args.tiny
    if args.rate is None and args.sweep is None and args.concurrency is None:
        args.concurrency = "4" if tiny else "64"
    args.specs = parse_point_specs(args.points) if args.points else None
    args.adapter_counts = [n for n, _ in args.specs] if args.specs else \
        [int(x) for x in (args.adapters or ("2" if tiny else "64")).split(",")]
    args.popularities = [(t, parse_popularity(t)) for t in args.popularity.split(",")]
    rates = [float(x) for x in args.sweep.split(",")] if args.sweep else []
    if args.rate is not None:  # measured first, at every adapter count
        rates = [args.rate, *(r for r in rates if r != args.rate)]
    args.loads = [Load(r, None) for r in rates] + [
        Load(None, int(c)) for c in (args.concurrency.split(",") if args.concurrency else [])]
    args.input_len = parse_lengths(args.input_len or ("8-32" if tiny else "128-512"))
    args.output_len = parse_lengths(args.output_len or ("8-16" if tiny else "128-256"))
    drain = args.drain_s if args.drain_s is not None else 30.0 if args.point_s else None
    if args.warm_s is not None and (args.point_s is None or not 0 <= args.warm_s < args.point_s):
        raise SystemExit("--warm-s needs --point-s greater than it")
    args.limits = Limits(*(float("inf") if v is None else v for v in (args.point_s, drain)),
                         warm_s=args.warm_s)


def _num_requests(args, load: Load) -> int:
    if args.num_requests:
        return args.num_requests
    if args.warm_s is not None:  # enough to keep sending until --point-s
        # a closed-loop stream's request takes >= 1 s on the GPU (>= 128 tokens), less
        # than 1/40 s on the CPU with the demo model's short outputs
        per_s = load.rate if load.rate is not None else \
            load.concurrency * (40 if args.tiny else 1)
        return max(32, int(per_s * args.point_s * 1.25))
    if args.tiny:
        return 16
    return 4 * load.concurrency if load.rate is None else max(32, int(load.rate * 30))


def _device_name(config: dict | None) -> str:
    """Where the engine ran (`config`: its resolved config, where known): "cpu", or the
    GPU's name. Asked once the service has stopped: a CUDA context in this process must
    not take GPU memory beside the service's engine."""
    if config and str(config.get("device", "")).startswith("cpu"):
        return "cpu"
    try:
        import torch
        return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001 - metadata only
        return "unknown"


def _meta(args, argv: list[str], config: dict | None) -> dict:
    device = args.device
    commit = os.environ.get("LORAMUX_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    first, steady, during = (next((p for p in args.points if p["round"] == r), None)
                             for r in ("first", "steady", "during loads"))
    return {"device": device, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": commit, "argv": argv, "engine_config": config,
            "adapters_loaded": args.loaded, "adapter_bytes": args.adapter_bytes,
            "loads": args.load_reports, "startup_s": args.startup_s, "warmup_s": args.warmup_s,
            "engine_warmup": args.engine_warmup,
            "first_round_over_steady": report.first_over_steady(first, steady),
            "first_round_over_steady_window": report.first_over_steady(first, steady, "service"),
            "during_loads_over_steady": report.first_over_steady(during, steady, "service"),
            "targets": report.targets(args.points),
            "windowed": args.warm_s is not None, "background_loads": args.background_loads,
            "order": "service: every point after one start"
                     + ("" if args.no_offline else "; then the offline engine")
                     + (" (the first point twice, no warm-up round)" if args.cold_first else
                        " (each after the same untimed warm-up round)"),
            "limits": {"point_s": args.limits.send_s, "drain_s": args.limits.drain_s,
                       "warm_s": args.limits.warm_s, "deadline_s": args.deadline_s},
            "popularity": args.popularity, "input_len": args.input_len,
            "output_len": args.output_len, "seed": args.seed,
            "slo": {"ttft_s": args.slo_ttft, "itl_s": args.slo_itl}}


def save(args, argv: list[str], config: dict | None = None) -> dict:
    """serving.json as it stands (rewritten after every point: a run cut short keeps what
    it measured)."""
    points = [{k: v for k, v in p.items() if k not in ("workload", "_make")}
              for p in args.points]
    result = {"meta": _meta(args, argv, config), "points": points}
    tmp = args.out / "serving.json.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=_jsonable))
    tmp.replace(args.out / "serving.json")
    return result


def _exit_on_sigterm(signum, _frame) -> None:
    """`timeout` stops a run with SIGTERM: leave through the `with` blocks, so the service
    (its own process group) is stopped and the GPU is free for the next run."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) \
        if "--" in argv else (argv, [])
    args = build_parser().parse_args(ours)
    _defaults(args)
    budget = Budget.starting_now(args.limits, args.deadline_s)
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="loramux-bench-serving-"))
    # one Triton cache for the service's engine and the offline engine (and later runs on
    # the same work dir): the second start-up loads what the first compiled
    os.environ.setdefault("TRITON_CACHE_DIR", str(Path(work).resolve() / "triton-cache"))
    # the service starts on the model dir while the adapters' files are written
    model, dummy = model_dir(work, args.tiny, args.layers)
    writing = ThreadPoolExecutor(1).submit(
        prepare, work, tiny=args.tiny, num_adapters=max(args.adapter_counts),
        distinct=args.distinct_weights, layers=args.layers)

    def files_ready():
        files = writing.result()
        args.adapter_bytes = files.adapter_bytes
        args.points[:] = make_points(
            args.adapter_counts, args.popularities, args.loads,
            lambda load: _num_requests(args, load), files.names, args.input_len,
            args.output_len, files.vocab, args.seed, args.cold_first, args.specs,
            args.background_loads)
        return files

    args.points, args.adapter_bytes = [], 0
    args.load_reports, args.startup_s, args.warmup_s = {}, {}, {}
    args.loaded, args.engine_warmup, args.engine_config = 0, None, None
    args.device = None  # known after the service part
    config = None
    try:
        config = run_service_points(args, ServiceFiles(model, adapter_root(work), dummy),
                                    files_ready, serve_argv, work, budget,
                                    lambda: save(args, argv))
        args.device = _device_name(config)
        if not args.no_offline:
            try:
                run_offline_points(args, args.files, config, budget,
                                   lambda: save(args, argv, config))
            except Exception:  # noqa: BLE001 - the service's rows are still worth a table
                traceback.print_exc()
                print("offline: failed; the table has the service's points only", flush=True)
    finally:  # stopped early (SIGTERM, a failure): the table of what was measured
        report_all(args, argv, config)
    return 0


def report_all(args, argv: list[str], config: dict | None) -> None:
    """serving.json, table.md and the plots; the table printed last."""
    if args.device is None:
        args.device = _device_name(config or args.engine_config)
    result = save(args, argv, config or args.engine_config)
    text = report.table(args.points, result["meta"])
    (args.out / "table.md").write_text(text + "\n")
    plots = report.plots(args.points, args.out)
    print(f"\n{result['meta']['device']}, commit {result['meta']['commit']}, "
          f"plots: {', '.join(plots) or 'none (no matplotlib or single point)'}\n{text}",
          flush=True)


def _jsonable(x):
    return dataclasses.asdict(x) if dataclasses.is_dataclass(x) else str(x)


if __name__ == "__main__":
    sys.exit(main())
