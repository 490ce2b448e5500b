"""The two halves of a serving benchmark run: every point through one start of the
service, then every point through the offline engine (built once the service's GPU memory
is back, so the two never share the GPU), each half after the same warm-up."""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serving import counters, report
from benchmarks.serving.drivers import run_offline, run_service, run_service_marked
from benchmarks.serving.loads import ServiceLoader, load_offline, load_service
from benchmarks.serving.plan import release, warmup_round, workload
from benchmarks.serving.workload import summarize, summarize_window


def _event_counters(cluster) -> dict | None:
    """The engine's counters from its next event (None if none comes)."""
    snap = _event_snapshot(cluster)
    return None if snap is None else snap[0]


def _wait_engine_idle(cluster, timeout_s: float = 10.0) -> float | None:
    """Wait for an engine event with nothing running or waiting (what a point cancelled at
    its end is gone, so the next point starts on an idle engine): the seconds waited, None
    if the engine was still busy after `timeout_s`."""
    t = time.perf_counter()
    msg = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event"
                              and m.event.running_requests == 0
                              and m.event.waiting_requests == 0, timeout_s)
    return None if msg is None else time.perf_counter() - t


def _event_snapshot(cluster) -> tuple[dict, float] | None:
    """(the counters of the engine's next event, when it arrived: perf_counter)."""
    msg = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event", 5)
    return None if msg is None else (counters.from_event(msg.event), time.perf_counter())


def _keep_logs(workdir: str, out: Path) -> None:
    """The services' logs next to the results (the engine's resolved config, errors)."""
    (out / "logs").mkdir(exist_ok=True)
    for log in Path(workdir).glob("*.log"):
        shutil.copyfile(log, out / "logs" / log.name)


def _timed(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def _points_to_run(args, system: str, budget):
    """The points in order, each only if it can still end before the deadline (the others
    are marked skipped)."""
    for p in args.points:
        why = ("deadline" if not budget.fits() else
               "adapters not loaded" if p["adapters"] > args.loaded else None)
        if why:
            _skip(p, system, why)
            continue
        yield p


def _finish(args, p: dict, system: str, records, wall: float, delta: dict | None,
            cpu: dict | None = None, window: tuple[float, float] | None = None,
            moved_s: float | None = None) -> None:
    """Summarize one point's run into p[system] and print its row. `window`: the part of
    the run measured (summarize_window; `moved_s` the seconds between the counters'
    snapshots at its edges)."""
    if window is None:
        s = summarize(records, wall, args.slo_ttft, args.slo_itl)
    else:
        s = summarize_window(records, *window, args.slo_ttft, args.slo_itl, stopped_s=wall)
        s["run_s"] = wall
        s["ran_out"] = sum(r.sent for r in records) == len(records)  # workload too short
        if p.get("round") in ("first", "steady"):  # the same from the start: all it served
            p[f"{system}_from_start"] = summarize_window(
                records, 0.0, window[1], args.slo_ttft, args.slo_itl, stopped_s=wall)
    s["engine"] = delta
    s["movement"] = counters.movement_rates(delta, moved_s or s["wall_s"], args.adapter_bytes)
    s["cpu_busy"] = cpu  # per process: CPU s / wall s (the service's processes)
    p[system] = s
    if system == "offline" and p.get("service"):
        a, b = p["service"]["output_tok_per_s"], s["output_tok_per_s"]
        p["service_over_offline"] = a / b if a and b else None
    print(report.row(p, args.points), flush=True)


def _warmup_line(log: str) -> str | None:
    """The engine server's start-up warm-up report ("engine warm-up 231.2 s: ...")."""
    lines = [ln for ln in log.splitlines() if ln.startswith("engine warm-up")]
    return lines[-1].removeprefix("engine ") if lines else None


def _warmup(args, files):
    """The untimed warm-up round over the adapters loaded (None with --cold-first); the
    same workload for both halves."""
    if args.cold_first:
        return None
    return warmup_round(args.points, files.names[:args.loaded], args.input_len, files.vocab,
                        args.seed)


@dataclass(frozen=True)
class ServiceFiles:
    """What the service starts on, before the adapters' files exist."""
    model: Path
    adapter_root: Path
    dummy_weights: bool


def run_service_points(args, start: ServiceFiles, files_ready, serve_argv: list[str],
                       work: Path, budget, save) -> dict:
    """Start the service; meanwhile files_ready() (the adapters' files, the points) and
    the points' workloads; then load the adapters, warm up, run every point. The engine's
    resolved config; args.files the Files."""
    from loramux_services.launcher import Cluster, wait_serving
    from loramux_services.serve_args import Plan, cluster_config, parse_args

    serve_dir = tempfile.mkdtemp(prefix="serve-", dir=work)  # a fresh registry each run
    flags = ["--model", str(start.model), "--adapter-root", str(start.adapter_root),
             "--gateway-port", "0", "--control-port", "0", "--metrics-port", "-1",
             "--http-port", "0", "--workdir", serve_dir, *serve_argv]
    if start.dummy_weights and "--load-format" not in serve_argv:
        flags += ["--load-format", "dummy"]
    plan = Plan(str(start.model), (str(start.adapter_root),), serve_dir, False)
    cfg = cluster_config(parse_args(flags), plan)
    try:
        with Cluster(cfg) as cluster:
            t = time.perf_counter()
            cluster.start()
            # every hard link exists before the first LoadAdapter (a lazy load's fingerprint
            # no longer covers the ctime a new link changes, but the files are ready first)
            files = args.files = files_ready()
            for p in args.points:  # drawn while the engine starts, not between points
                workload(p)
            print(f"service: adapter files and workloads ready {time.perf_counter() - t:.1f} s "
                  "after the start (while the engine starts)", flush=True)
            ready = cluster.wait_ready(timeout_s=900)
            wait_serving(cluster.gateway_address, timeout_s=900)
            args.serving_at = time.perf_counter()
            args.startup_s["service"] = args.serving_at - t
            args.engine_config = ready["engine"].get("config")
            print(f"service: serving {args.startup_s['service']:.1f} s after start; engine: "
                  f"{ready['engine'].get('config')}", flush=True)
            args.engine_warmup = _warmup_line(cluster.log_tail("engine", 1_000_000))
            print(f"service: {args.engine_warmup or 'no engine warm-up (CPU)'}", flush=True)
            pids = {"client": None, **{n: ready[n].get("pid") for n in ("gateway", "engine")}}
            if args.background_loads:
                _background_points(args, files, cluster, pids, budget, save)
            else:
                _upfront_points(args, files, cluster, pids, budget, save)
    finally:
        _keep_logs(serve_dir, args.out)
    return ready["engine"]["config"]


def _upfront_points(args, files, cluster, pids: dict, budget, save) -> None:
    """Every adapter loaded first (within --load-s), the warm-up round, then the points."""
    used = list(files.names[:max(p["adapters"] for p in args.points)])
    loads = load_service(cluster.control_address, used, args.load_workers, args.load_s)
    args.load_reports["service"] = loads.summary()
    args.loaded = loads.adapters
    print(f"service: loaded {loads}", flush=True)
    warmup = _warmup(args, files)
    if warmup is not None:
        args.warmup_s["service"] = _timed(run_service, cluster.gateway_address, *warmup)
    print(report.header(), flush=True)
    for p in _points_to_run(args, "service", budget):
        _run_service_point(args, p, cluster, pids, budget)
        save()


def _background_points(args, files, cluster, pids: dict, budget, save) -> None:
    """Only the first point's adapters are loaded before it (the first of them alone: one
    load's latency); the other adapters load in the background from the first point that
    is not the first round or its repeat on (the "during loads" round measures what loads
    cost the traffic). A point runs once its adapters are loaded, the first such in the
    points' order; before one, outstanding loads get up to --settle-s (over the run) to
    finish, so that later points run without loads beside them (each row counts the loads
    that completed in its window)."""
    used = list(files.names[:max(p["adapters"] for p in args.points)])
    first_n = args.points[0]["adapters"]
    loader = ServiceLoader(cluster.control_address, args.load_workers)
    args.loader = loader
    try:
        alone = [loader.load_now([name]) for name in used[:min(2, first_n)]]
        print("service: one adapter alone: LoadAdapter " + ", then ".join(
            f"{r['wall_s'] * 1e3:.1f} ms" for r in alone) + " (the first loads after start)",
              flush=True)
        args.load_reports["service_one"] = alone[0]
        if len(alone) > 1:
            args.load_reports["service_second"] = alone[1]
        if first_n > 2:
            args.load_reports["service_first"] = loader.load_now(used[2:first_n])
        args.loaded = loader.loaded
        print(report.header(), flush=True)
        pending, settle_left, background = list(args.points), args.settle_s, None
        while pending:
            p = next((q for q in pending if q["adapters"] <= loader.loaded), None)
            if p is None:
                if not budget.fits() or not loader.busy:
                    why = "deadline" if not budget.fits() else "adapters not loaded"
                    for q in pending:
                        _skip(q, "service", why)
                    break
                loader.wait_for(min(q["adapters"] for q in pending), timeout_s=0.5)
                args.loaded = loader.loaded
                continue
            pending.remove(p)
            if background is None and p.get("round") not in ("first", "steady"):
                loader.start(used[loader.loaded:])
                background = len(loader.batches) - 1
            elif p.get("round") != "during loads" and loader.busy and settle_left > 0:
                t = time.perf_counter()
                loader.wait_for(len(used), timeout_s=min(settle_left, max(0.0, budget.left_s()
                                                         - budget.limits.total_s)))
                settle_left -= time.perf_counter() - t
            args.loaded = loader.loaded
            if not budget.fits():
                _skip(p, "service", "deadline")
                continue
            _run_service_point(args, p, cluster, pids, budget)
            save()
        if background is not None:
            args.load_reports["service"] = loader.batch_report(background)
        if loader.error:
            print(f"service: adapter loads stopped: {loader.error}", flush=True)
        args.loaded = loader.loaded
    finally:
        loader.close()


def _skip(p: dict, system: str, why: str) -> None:
    p.setdefault("skipped", {})[system] = why
    print(f"{system}: skipped ({why}) {report.label(p)}", flush=True)


def _run_service_point(args, p: dict, cluster, pids: dict, budget) -> None:
    """One point through the service: whole-run counters, or (--warm-s) the window's."""
    wl = workload(p)
    limits = budget.limits
    p["started_s"] = time.perf_counter() - args.serving_at
    print(f"service: {report.label(p)}: starts {p['started_s']:.0f} s after serving, "
          f"{budget.left_s():.0f} s before the deadline", flush=True)
    try:
        if limits.warm_s is None:
            before = _event_counters(cluster)
            (records, wall), cpu = counters.busy_share(pids, lambda: run_service(
                cluster.gateway_address, wl, p["concurrency"], limits))
            _finish(args, p, "service", records, wall,
                    counters.during(_event_counters(cluster), before), cpu)
            return

        def snapshot(_k: int) -> dict:
            t = time.perf_counter()
            cpu = {k: counters.cpu_seconds(pid) for k, pid in pids.items()}
            return {"t": t, "cpu": cpu, "event": _event_snapshot(cluster)}

        records, wall, (a, b) = run_service_marked(
            cluster.gateway_address, wl, p["concurrency"], limits,
            (limits.warm_s, limits.send_s), snapshot)
        p["idle_after_s"] = _wait_engine_idle(cluster)  # the cancelled requests are gone
        if p["idle_after_s"] is None or p["idle_after_s"] > 2.0:
            print(f"service: the engine was idle only {p['idle_after_s']} s after the point "
                  "(None: still busy after 10 s)", flush=True)
        dt = b["t"] - a["t"]
        cpu = {k: None if a["cpu"][k] is None or b["cpu"][k] is None or dt <= 0
               else (b["cpu"][k] - a["cpu"][k]) / dt for k in pids}
        delta = moved_s = None
        if a["event"] and b["event"]:
            delta = counters.during(b["event"][0], a["event"][0])
            moved_s = b["event"][1] - a["event"][1]
        loader = getattr(args, "loader", None)
        if loader is not None:
            p["loads_in_window"] = loader.loads_between(a["t"], b["t"])
        _finish(args, p, "service", records, wall, delta, cpu,
                (limits.warm_s, min(limits.send_s, wall)), moved_s)
    finally:
        release(p)


OFFLINE_SETUP_S = 120.0  # the offline engine's build and warm-up, budgeted before it starts


def wait_gpu_released(timeout_s: float = 60.0, share: float = 0.9) -> None:
    """Before the offline engine sizes itself from free GPU memory: wait until the
    service's engine has given its memory back (at least `share` of the GPU free)."""
    import torch

    if not torch.cuda.is_available():
        return
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = torch.cuda.mem_get_info()
        if free >= share * total or time.monotonic() > deadline:
            print(f"offline: GPU memory free {free / 2**30:.1f} of {total / 2**30:.1f} GiB",
                  flush=True)
            if free < share * total:
                raise RuntimeError("the service's engine still holds GPU memory")
            return
        time.sleep(0.5)


def run_offline_points(args, files, config: dict, budget, save) -> None:
    """The same points through an in-process Engine with the service's resolved config,
    warmed up as the engine server warms up (Engine.warm_up), with the same adapters
    loaded the same concurrent way, after the same warm-up round."""
    import torch

    from loramux_engine import Engine, EngineConfig

    # building and warming up an 8B engine from cached kernels: about 1.5 min on an H100
    setup_s = OFFLINE_SETUP_S if torch.cuda.is_available() else 0.0
    if not budget.fits(extra_s=setup_s):
        print(f"offline: skipped (deadline: {budget.left_s():.0f} s left)", flush=True)
        for p in args.points:
            p.setdefault("skipped", {})["offline"] = "deadline"
        return
    wait_gpu_released()
    t = time.perf_counter()
    with Engine(EngineConfig(**config)) as engine:
        warm = engine.warm_up()  # as engine/server/main.py does before it serves
        args.startup_s["offline"] = time.perf_counter() - t
        print(f"offline: ready {args.startup_s['offline']:.1f} s after start"
              + (f" ({warm})" if warm else ""), flush=True)
        used = list(files.names[:args.loaded])  # those the service had
        loads = load_offline(engine, files.adapter_root, used, args.load_workers)
        args.load_reports["offline"] = loads.summary()
        print(f"offline: loaded {loads}", flush=True)
        warmup = _warmup(args, files)
        if warmup is not None:
            args.warmup_s["offline"] = _timed(run_offline, engine, *warmup)
        for p in _points_to_run(args, "offline", budget):
            before = counters.from_engine(engine)
            records, wall = run_offline(engine, workload(p), p["concurrency"], budget.limits)
            release(p)
            window = None if budget.limits.warm_s is None else \
                (budget.limits.warm_s, min(budget.limits.send_s, wall))
            _finish(args, p, "offline", records, wall,
                    counters.during(counters.from_engine(engine), before), window=window)
            save()
