"""`loramux serve`: control plane, engine and gateway as three local processes.

With no --model it serves the demo model (made once in the cache directory) and loads its
two adapters, so a fresh machine serves at once. Ctrl-C or SIGTERM drains: the gateway
refuses new calls, in-flight streams finish within --shutdown-grace, then the engine and
control plane stop; a second Ctrl-C stops everything at once."""
from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loramux serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF model directory (default: the demo model)")
    p.add_argument("--adapter-root", action="append", default=[],
                   help="directory adapters may be registered from (repeatable)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--gateway-port", type=int, default=50051)
    p.add_argument("--control-port", type=int, default=50052)
    p.add_argument("--metrics-port", type=int, default=9090)
    p.add_argument("--http-port", type=int, default=8000,
                   help="OpenAI-compatible HTTP API port (0: off)")
    p.add_argument("--auth-token", default=None,
                   help="bearer token for admin calls and the HTTP API")
    p.add_argument("--workdir", default=None, help="registry and logs (default: a temp dir "
                   "for the demo, <cache>/serve otherwise)")
    p.add_argument("--cache-dir", default=None, help="where the demo model is made")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds in-flight streams may take to finish on stop (default: 30)")
    return p


def _device(arg: str | None) -> str:
    if arg:
        return arg
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _load_demo_adapters(cluster, token: str | None) -> None:
    from loramux.client import AdminClient

    from services.demo_model import DEMO_ADAPTERS

    with AdminClient(cluster.control_address, token=token) as admin:
        for name in DEMO_ADAPTERS:
            admin.load(name, name)


class _ForcedStop(Exception):
    """A second stop signal while draining."""


def _install_stop_signals() -> threading.Event:
    """First SIGINT/SIGTERM: set the returned event (drain). Second: _ForcedStop."""
    stop = threading.Event()

    def handler(*_):
        if stop.is_set():
            raise _ForcedStop
        stop.set()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)
    return stop


def _drain(cluster, grace_s: float) -> None:
    if cluster.procs:
        print(f"loramux: draining (in-flight streams have up to {grace_s:g} s; "
              "Ctrl-C again stops at once)", file=sys.stderr, flush=True)
    try:
        cluster.close()
    except _ForcedStop:
        cluster.kill_all()


def main(argv: list[str] | None = None) -> int:
    from services.demo_model import default_cache_dir, ensure_demo
    from services.launcher import Cluster, ClusterConfig, wait_serving

    args = build_parser().parse_args(argv)
    demo = args.model is None
    if demo:
        print("loramux: preparing the demo model (once) ...", file=sys.stderr, flush=True)
        model = str(ensure_demo(args.cache_dir))
        roots = [str(Path(model) / "adapters"), *args.adapter_root]
    else:
        model, roots = args.model, args.adapter_root or [args.model]
    workdir = args.workdir or (tempfile.mkdtemp(prefix="loramux-serve-") if demo
                               else str(default_cache_dir() / "serve"))
    cluster = Cluster(ClusterConfig(
        model=model, adapter_roots=tuple(roots), workdir=workdir, host=args.host,
        gateway_port=args.gateway_port, control_port=args.control_port,
        metrics_port=args.metrics_port, http_port=args.http_port or -1,
        auth_token=args.auth_token,
        tensor_parallel_size=args.tensor_parallel_size, shutdown_grace_s=args.shutdown_grace,
        engine_args=("--device", _device(args.device))))
    stop = _install_stop_signals()
    try:
        cluster.start()
        cluster.wait_ready()
        wait_serving(cluster.gateway_address, timeout_s=600)
        if demo:
            _load_demo_adapters(cluster, args.auth_token)
        print(f"loramux serving {model}\n  gateway  {cluster.gateway_address}\n"
              f"  http     {cluster.http_address or 'off'}\n"
              f"  control  {cluster.control_address}\n  logs     {workdir}\n"
              f"try: loramux generate --gateway {cluster.gateway_address} "
              f"{'--adapter demo-a ' if demo else ''}\"hello\"   (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        while not stop.is_set():
            if dead := cluster.dead():
                print(f"loramux: {', '.join(dead)} exited; stopping. Logs in {workdir}",
                      file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        _drain(cluster, args.shutdown_grace)
