"""`loramux serve`: control plane, engine (or --replicas engines) and gateway as local
processes.

With no --model it serves the demo model (made once in the cache directory) and loads its
two adapters, so a fresh machine serves at once. Ctrl-C or SIGTERM drains: the gateway
refuses new calls, in-flight streams finish within --shutdown-grace, then the engine and
control plane stop; a second Ctrl-C stops everything at once.

Once serving, every process is supervised (services/supervisor.py): a dead one starts
again after a backoff, and a crash loop stops the service. Fixed ports are checked before
anything slow (services/port_check.py)."""
from __future__ import annotations

import signal
import sys
import threading
import time


def _load_demo_adapters(cluster, token: str | None, tls) -> None:
    from loramux.client import AdminClient

    from loramux_services.demo_model import DEMO_ADAPTERS

    with AdminClient(cluster.control_address, token=token, tls=tls) as admin:
        for name in DEMO_ADAPTERS:
            admin.load(name, name)


class _ForcedStop(Exception):
    """A stop signal that must not wait: the second one, or one before serving began."""


class _StopSignals:
    """First SIGINT/SIGTERM while serving: `requested` is set (drain). Any other: _ForcedStop."""

    def __init__(self):
        self.requested = threading.Event()
        self.serving = False
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)

    def _handle(self, *_):
        if self.requested.is_set() or not self.serving:
            raise _ForcedStop
        self.requested.set()


def _drain(cluster, grace_s: float, serving: bool) -> None:
    if cluster.procs and serving:
        print(f"loramux: draining (in-flight streams have up to {grace_s:g} s; "
              "Ctrl-C again stops at once)", file=sys.stderr, flush=True)
    try:
        cluster.close()
    except _ForcedStop:
        cluster.kill_all()


def _started(cluster, workdir: str, tls) -> str | None:
    """None once every service is ready and the gateway is SERVING, else why not (the
    failing service's last error line)."""
    from loramux_services.launcher import wait_serving

    try:
        ready = cluster.wait_ready(timeout_s=600)
        wait_serving(cluster.gateway_address, timeout_s=600, tls=tls)
    except (RuntimeError, TimeoutError) as err:
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "error" in ln.lower()]
        return f"{lines[0]} {(errors or lines)[-1].strip()} (logs in {workdir})"
    config = ready[cluster.engine_names[0]].get("config", {})
    replicas = f" x{len(cluster.engine_names)} replicas" if len(cluster.engine_names) > 1 else ""
    print(f"loramux engine{replicas}: " + " ".join(f"{k}={v}" for k, v in config.items()
                                          if k not in ("model",)), file=sys.stderr, flush=True)
    return None


def _supervise(cluster, policy, stop: _StopSignals) -> int:
    """Keep every process alive until a stop signal (0) or a crash loop (1)."""
    from loramux_services.supervisor import CrashLoop, Supervisor

    supervisor = Supervisor(cluster, policy)
    while not stop.requested.is_set():
        try:
            supervisor.poll()
        except CrashLoop as err:
            print(f"loramux: {err}", file=sys.stderr, flush=True)
            return 1
        time.sleep(0.2)
    return 0


def main(argv: list[str] | None = None) -> int:
    from loramux_services.launcher import Cluster
    from loramux_services.port_check import fixed_ports, port_problem
    from loramux_services.start_progress import StartProgress
    from loramux_services.serve_args import (client_tls, cluster_config, files, parse_args,
                                     restart_policy)

    args = parse_args(argv)
    if (why := port_problem(args.host, fixed_ports(args))) is not None:
        print(f"loramux: {why}", file=sys.stderr)  # before the demo model or any warm-up
        return 1
    if args.model is None:
        print("loramux: preparing the demo model (once) ...", file=sys.stderr, flush=True)
    plan = files(args)
    cluster = Cluster(cluster_config(args, plan))
    tls = client_tls(args)
    stop = _StopSignals()
    try:
        # the engines' start-up progress (weights, compiles, graphs) shows here meanwhile
        with StartProgress({n: cluster.log_path(n) for n in cluster.engine_names}):
            cluster.start()
            why = _started(cluster, plan.workdir, tls)
        if why is not None:
            print(f"loramux: {why}", file=sys.stderr)
            return 1
        if plan.demo:
            _load_demo_adapters(cluster, args.auth_token, tls)
        print(f"loramux serving {plan.model}\n  gateway  {cluster.gateway_address}\n"
              f"  http     {cluster.http_address or 'off'}\n"
              f"  control  {cluster.control_address}\n  logs     {plan.workdir}\n"
              f"try: loramux generate --gateway {cluster.gateway_address} "
              f"{'--adapter demo-a ' if plan.demo else ''}\"hello\"   (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        stop.serving = True
        return _supervise(cluster, restart_policy(args), stop)
    except _ForcedStop:
        cluster.kill_all()
        return 130
    finally:
        _drain(cluster, args.shutdown_grace, stop.serving)


if __name__ == "__main__":
    sys.exit(main())
