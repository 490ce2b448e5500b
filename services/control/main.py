"""Command line of the control plane (`python -m loramux_services.control`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys

from loramux.v1 import adapter_admin_pb2, adapter_admin_pb2_grpc

from loramux_core import curve
from loramux_core.gc_heap import freeze_heap
from loramux_core.options import OneLineErrors, positive_float, positive_int
from loramux_core.safe_files import roots_from
from loramux_services.common import grpc_server, replicas, service_args, tls
from loramux_services.common.bind_errors import BindError, bind_flag
from loramux_services.common.logs import configure_logging

SERVICE = adapter_admin_pb2.DESCRIPTOR.services_by_name["AdapterAdminService"].full_name


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = OneLineErrors(prog="python -m loramux_services.control",
                      description="loramux control plane (AdapterAdminService)")
    p.add_argument("--listen", default=env("LORAMUX_CONTROL_LISTEN", "127.0.0.1:50052"),
                   help="gRPC host:port (port 0 picks a free one)")
    p.add_argument("--model", default=env("LORAMUX_MODEL"), help="base model directory")
    p.add_argument("--db", default=env("LORAMUX_CONTROL_DB"), help="SQLite registry file")
    p.add_argument("--adapter-root", action="append", default=None,
                   help="directory adapters may live in (repeatable; $LORAMUX_ADAPTER_ROOTS, "
                        "':'-separated)")
    replicas.add_arguments(p)
    p.add_argument("--table-address", default=env("LORAMUX_TABLE_ADDRESS"),
                   help="ZMQ address to bind for publishing the adapter table to gateways")
    p.add_argument("--max-lora-rank", type=positive_int, default=env("LORAMUX_MAX_LORA_RANK", "16"),
                   help="largest adapter rank accepted; the engine's --max-lora-rank (default: 16)")
    p.add_argument("--auth-token", default=env("LORAMUX_ADMIN_TOKEN"),
                   help="bearer token required on admin calls ($LORAMUX_ADMIN_TOKEN)")
    p.add_argument("--heartbeat-timeout", type=positive_float,
                   default=env("LORAMUX_HEARTBEAT_TIMEOUT", "1.5"),
                   help="seconds without an engine heartbeat before the engine counts as gone "
                        "(default: 1.5)")
    p.add_argument("--replica-failed-after", type=positive_float,
                   default=env("LORAMUX_REPLICA_FAILED_AFTER", "120"),
                   help="seconds without a heartbeat from a replica that had sent some before "
                        "it counts as failed rather than restarting (default: 120)")
    p.add_argument("--metrics-port", type=int, default=int(env("LORAMUX_CONTROL_METRICS_PORT", "-1")),
                   help="Prometheus /metrics HTTP port for admin-call metrics "
                        "(0 picks one, -1 disables: the default)")
    p.add_argument("--metrics-host", default=env("LORAMUX_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--ready-file", default=None)
    tls.add_arguments(p)
    curve.add_arguments(p)
    p.add_argument("--log-level", default=env("LORAMUX_LOG_LEVEL", "info"))
    return p


def make_validator(model_dir: str, max_lora_rank: int, roots, header_only: bool = False):
    """The engines' adapter validator (loramux_core/adapter/plan.py), bound to the base
    model and the adapter roots: path -> (rank, target modules, version); `header_only`:
    path -> (rank, target modules, fingerprint), the tensors neither read nor hashed (the
    engines do that on load; the fingerprint is the version of an adapter an engine
    registered without reading it: engine/server/adapter_commands.py)."""
    from loramux_core.adapter.plan import PlanCache, plan_adapter
    from loramux_core.model.hf_config import ModelConfig

    model_cfg = ModelConfig.from_dir(model_dir)
    plans = PlanCache()

    def validate(path: str):
        plan = plan_adapter(path, model_cfg, max_lora_rank, roots, header_only=header_only,
                            cache=plans)
        found = int(plan.max_rank), tuple(sorted(plan.target_modules))
        return (*found, plan.fingerprint if header_only else plan.version)
    return validate


def _log_transition(log):
    def said(replica: int, old: str, new: str, detail: str) -> None:
        log.info("replica_state", replica=replica, old=old, new=new, detail=detail)
    return said


async def _watch_states(states, period_s: float = 0.5) -> None:
    """Log each replica's transitions as they happen, not only when someone asks."""
    while True:
        states.status()
        await asyncio.sleep(period_s)


async def serve(args) -> int:
    from loramux_services.control.auth import BearerTokenInterceptor
    from loramux_services.control.binding import binding_for
    from loramux_services.control.binding import prepare as prepare_registry
    from loramux_services.control.engine_link import EngineLink
    from loramux_services.control.manager import AdapterManager
    from loramux_services.control.metrics import ControlMetrics
    from loramux_services.control.paths import AdapterRoots
    from loramux_services.control.registry import Registry
    from loramux_services.control.replica_states import ReplicaStates
    from loramux_services.control.servicer import AdapterAdminServicer
    from loramux_services.control.table_publisher import TablePublisher

    log = configure_logging("control", args.log_level)
    roots = roots_from(args.adapter_root, os.environ)
    binding = await asyncio.to_thread(binding_for, args.model, roots)
    prepare_registry(args.db, binding, log)
    registry = Registry(args.db, binding.to_json())
    with bind_flag("--table-address", args.table_address):
        table = TablePublisher(args.table_address, keys=args.keys, replicas=len(args.engines))
    manager_box: list[AdapterManager] = []
    metrics = ControlMetrics()
    with bind_flag("--metrics-port", f"{args.metrics_host}:{args.metrics_port}"):
        metrics_port = (metrics.serve(args.metrics_port, args.metrics_host)
                        if args.metrics_port >= 0 else -1)

    def replay(replica: int):
        async def run(instance: str) -> None:
            # the link connects once the engine says SERVING (EngineConnection.up), so
            # its adapter commands are read at once
            states.up(replica, instance)
            metrics.replays.inc()
            await manager_box[0].replay(replica, instance)
        return run

    links = [EngineLink(input_address, output_address, on_connect=replay(index),
                        on_event=lambda ev: manager_box[0].on_event(ev),
                        on_down=lambda reason, i=index: states.down(i),
                        heartbeat_timeout_s=args.heartbeat_timeout, keys=args.keys)
             for index, (input_address, output_address) in enumerate(args.engines)]
    states = ReplicaStates(links, lambda replica: table.replayed[replica],
                           args.replica_failed_after, on_change=_log_transition(log))
    metrics.watch_replicas(states)
    adapter_roots = AdapterRoots(roots)
    manager = AdapterManager(registry, adapter_roots,
                             make_validator(args.model, args.max_lora_rank, adapter_roots),
                             links, table,
                             make_validator(args.model, args.max_lora_rank, adapter_roots,
                                            header_only=True))
    manager_box.append(manager)
    interceptors = [BearerTokenInterceptor(args.auth_token)] if args.auth_token else []
    server = grpc_server.make_server(interceptors=interceptors)
    adapter_admin_pb2_grpc.add_AdapterAdminServiceServicer_to_server(
        AdapterAdminServicer(manager, metrics, states), server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE])
    with bind_flag("--listen", args.listen):
        address = grpc_server.bind(server, args.listen, args.tls)
    await server.start()
    await grpc_server.mark_alive(health)
    table.start()
    table.publish(registry.all())
    for link in links:
        await link.start()
    await grpc_server.set_serving(health, [SERVICE], True)
    frozen = freeze_heap()  # what start-up made lives until exit: a full collection never walks it
    grpc_server.write_ready_file(args.ready_file, {"address": address, "table": table.address,
                                                   "metrics_port": metrics_port, "pid": os.getpid(),
                                                   "gc_frozen": frozen})
    log.info("serving", address=address, table=table.address, adapters=len(registry.all()),
             replicas=len(links))
    watch = asyncio.create_task(_watch_states(states))
    stop = asyncio.Event()
    grpc_server.install_stop_signals(stop)
    await stop.wait()
    log.info("stopping")
    watch.cancel()
    await health.enter_graceful_shutdown()
    await server.stop(5.0)
    for link in links:
        await link.close()
    await table.close()
    registry.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from loramux_core import open_audit
    open_audit.install_from_env("control")
    args = build_parser().parse_args(argv)
    why = service_args.check(args, ("model", "db", "engine_input", "engine_output",
                                    "table_address"), require_roots=True, check_token=True)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args))
    except BindError as err:  # one line naming the flag, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
