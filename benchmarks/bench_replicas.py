"""Scale-out benchmark: the same closed-loop workload through the real service (launcher,
gateway, control plane) with the engine laid out three ways over the GPUs: one replica on
one GPU, N replicas of one GPU each (routed by adapter affinity and load), one replica of
tensor parallelism N. Reports output tokens/s in all and per GPU, and the router's
decisions.

    python -m benchmarks.parallel replicas --out DIR                  # 2 GPUs: 1x1, 2x1, 1x2
    python -m benchmarks.parallel replicas --out DIR --tiny           # CPU, demo model
    python -m benchmarks.parallel replicas --out DIR -- --max-loras 16  # after --: serve flags

A layout is REPLICASxTP (--layouts 1x1,2x1,1x2). Each starts the service afresh (the
engines on GPUs 0.. of $CUDA_VISIBLE_DEVICES), loads --adapters adapters (every replica
gets every one), runs an untimed warm-up round, then --requests requests from
--concurrency-per-gpu streams per GPU (so each layout is offered the same load per GPU),
adapters picked by --popularity. Model: Llama-3-8B-shaped with random weights (as
bench_serving.py), or with --tiny the demo model on the CPU. Writes replicas.json and the
services' logs to --out; prints the table last."""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # last: hides nothing installed

from benchmarks.serving.drivers import Limits, run_service  # noqa: E402
from benchmarks.serving.files import prepare  # noqa: E402
from benchmarks.serving.loads import load_service  # noqa: E402
from benchmarks.serving.workload import (make_workload, parse_lengths,  # noqa: E402
                                         parse_popularity, summarize)


def parse_layouts(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        replicas, _, tp = item.strip().partition("x")
        try:
            out.append((int(replicas), int(tp or 1)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: a layout is REPLICASxTP, e.g. 2x1") from None
        if min(out[-1]) < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: replicas and TP are at least 1")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for replicas.json and the logs")
    p.add_argument("--tiny", action="store_true", help="the demo model on the CPU, small load")
    p.add_argument("--layouts", type=parse_layouts, default=None,
                   help="REPLICASxTP,... (default: 1x1,2x1,1x2)")
    p.add_argument("--adapters", type=int, default=None, help="adapters loaded (default: 64; tiny: 4)")
    p.add_argument("--popularity", type=parse_popularity, default="zipf:1",
                   help="uniform or zipf:ALPHA (default: zipf:1)")
    p.add_argument("--requests-per-gpu", type=int, default=None,
                   help="requests per GPU of the layout (default: 512; tiny: 8)")
    p.add_argument("--concurrency-per-gpu", type=int, default=None,
                   help="closed-loop streams per GPU (default: 128; tiny: 4)")
    p.add_argument("--input-len", type=parse_lengths, default=None,
                   help="prompt tokens N or LO-HI (default: 256-1024; tiny: 8-32)")
    p.add_argument("--output-len", type=parse_lengths, default=None,
                   help="output tokens N or LO-HI (default: 128-256; tiny: 4-8)")
    p.add_argument("--layers", type=int, default=None, help="layers of the 8B-shaped model")
    p.add_argument("--point-s", type=float, default=300.0,
                   help="no request is sent later than this into a layout's run (default: 300)")
    p.add_argument("--drain-s", type=float, default=120.0,
                   help="then what still runs this much later is cancelled (default: 120)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("serve_args", nargs=argparse.REMAINDER,
                   help="after --: flags for `loramux serve` (every layout)")
    return p


def defaults(args) -> None:
    tiny = args.tiny
    args.layouts = args.layouts or [(1, 1), (2, 1), (1, 2)]
    args.adapters = args.adapters or (4 if tiny else 64)
    args.requests_per_gpu = args.requests_per_gpu or (8 if tiny else 512)
    args.concurrency_per_gpu = args.concurrency_per_gpu or (4 if tiny else 128)
    args.input_len = args.input_len or ((8, 32) if tiny else (256, 1024))
    args.output_len = args.output_len or ((4, 8) if tiny else (128, 256))
    args.serve_args = [a for a in args.serve_args if a != "--"]


def routed(metrics_url: str) -> dict[str, float]:
    """The gateway's routing decisions so far: {decision: requests, "replica N": requests}
    (the second kind tells whether the replicas got even shares)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "loramux:routed_requests_total":
                for key in (s.labels["decision"], f"replica {s.labels['replica']}"):
                    out[key] = out.get(key, 0.0) + s.value
    return out


def cluster_for(args, files, replicas: int, tp: int, work: Path):
    from loramux_services.launcher import Cluster
    from loramux_services.serve_args import Plan, cluster_config, parse_args

    serve_dir = tempfile.mkdtemp(prefix=f"serve-{replicas}x{tp}-", dir=work)
    flags = ["--model", str(files.model), "--adapter-root", str(files.adapter_root),
             "--gateway-port", "0", "--control-port", "0", "--metrics-port", "0",
             "--http-port", "0", "--workdir", serve_dir, "--replicas", str(replicas),
             "--tensor-parallel-size", str(tp), *args.serve_args]
    if files.dummy_weights and "--load-format" not in args.serve_args:
        flags += ["--load-format", "dummy"]
    cfg = cluster_config(parse_args(flags), Plan(str(files.model), (str(files.adapter_root),),
                                                 serve_dir, False))
    return Cluster(cfg), serve_dir


def run_layout(args, files, replicas: int, tp: int, work: Path) -> dict:
    from loramux_services.launcher import wait_serving

    gpus = replicas * tp
    cluster, serve_dir = cluster_for(args, files, replicas, tp, work)
    names = list(files.names[:args.adapters])
    row = {"layout": f"{replicas}x{tp}", "replicas": replicas, "tp": tp, "gpus": gpus}
    try:
        with cluster:
            t = time.perf_counter()
            cluster.start()
            ready = cluster.wait_ready(timeout_s=900)
            wait_serving(cluster.gateway_address, timeout_s=900)
            row["startup_s"] = time.perf_counter() - t
            loads = load_service(cluster.control_address, names, workers=8)
            row["load"] = loads.summary()
            concurrency = args.concurrency_per_gpu * gpus
            warmup = make_workload(2 * concurrency, [None, *names], None, args.input_len,
                                   (4, 16), files.vocab, None, args.seed + 1)
            run_service(cluster.gateway_address, warmup, concurrency)
            url = f"http://127.0.0.1:{ready['gateway']['metrics_port']}/metrics"
            before = routed(url)
            workload = make_workload(args.requests_per_gpu * gpus, names, args.popularity,
                                     args.input_len, args.output_len, files.vocab, None, args.seed)
            records, wall = run_service(cluster.gateway_address, workload, concurrency,
                                        Limits(args.point_s, args.drain_s))
            after = routed(url)
            row["routing"] = {k: v - before.get(k, 0.0) for k, v in after.items()}
            row.update(summarize(records, wall, slo_ttft_s=1.0, slo_itl_s=0.1))
            row["concurrency"] = concurrency
            row["engine"] = ready[cluster.engine_names[0]].get("config")
    finally:
        keep = Path(args.out) / "logs" / row["layout"]
        keep.mkdir(parents=True, exist_ok=True)
        for log in Path(serve_dir).glob("*.log"):
            (keep / log.name).write_bytes(log.read_bytes())
    tok = row.get("output_tok_per_s") or 0.0
    row["output_tok_per_s_per_gpu"] = tok / gpus
    return row


def _f(x, digits=1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["gpus"] == 1), None)
    lines = ["| layout | GPUs | streams | done/sent | tok/s | tok/s/GPU | vs 1x1 per GPU | "
             "TTFT p50 ms | ITL p50 ms | affinity hits | spills | requests per replica |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['gpus']} | failed: {r['error'][:80]} |")
            continue
        route = r.get("routing", {})
        total = sum(v for k, v in route.items() if not k.startswith("replica "))
        hits = (route.get("slot", 0) + route.get("host", 0)) / total if total else None
        rel = (r["output_tok_per_s_per_gpu"] / base["output_tok_per_s_per_gpu"]
               if base and base.get("output_tok_per_s_per_gpu") else None)
        lines.append(
            f"| {r['layout']} | {r['gpus']} | {r['concurrency']} | {r['completed']}/{r['requests']} | "
            f"{_f(r['output_tok_per_s'])} | {_f(r['output_tok_per_s_per_gpu'])} | {_f(rel, 2)} | "
            f"{_f((r['ttft_s']['p50'] or 0) * 1e3)} | {_f((r['itl_s']['p50'] or 0) * 1e3, 2)} | "
            f"{_f(None if hits is None else 100 * hits)}% | {int(route.get('spill', 0))} | "
            f"{' / '.join(str(int(v)) for k, v in sorted(route.items()) if k.startswith('replica '))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    defaults(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    files = prepare(work, tiny=args.tiny, num_adapters=args.adapters, distinct=4,
                    layers=args.layers)
    rows = []
    for replicas, tp in args.layouts:
        print(f"layout {replicas}x{tp}: starting", flush=True)
        try:
            rows.append(run_layout(args, files, replicas, tp, work))
        except Exception as err:  # noqa: BLE001 - one layout failing still reports the others
            rows.append({"layout": f"{replicas}x{tp}", "gpus": replicas * tp,
                         "error": f"{type(err).__name__}: {err}"})
        print(f"layout {replicas}x{tp}: {json.dumps(rows[-1].get('output_tok_per_s'))} tok/s",
              flush=True)
        (out / "replicas.json").write_text(json.dumps({"args": {
            k: v for k, v in vars(args).items() if k != "popularity"}, "rows": rows},
            indent=1, default=str))
    text = table(rows)
    (out / "table.md").write_text(text + "\n")
    print(text)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
